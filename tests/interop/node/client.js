#!/usr/bin/env node
// A vllm.grpc.engine.VllmEngine client on Node's @grpc/grpc-js: an HTTP/2 + gRPC stack that
// shares no code with grpcio (C-core), Envoy or kvswitch. It makes a fixed set of calls against
// one address and prints one JSON object of what it observed; the Python test asserts on it.
//
//   node client.js '<json>'   with {address, protoDir, promptIds, metadata, longMaxTokens,
//                                    deadlineMs, healthDescriptorSet?}
//
// Every check is reported, never thrown: a failed call becomes {code, details}.
'use strict';

const fs = require('fs');
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const LOADER_OPTIONS = { keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true };
const CALL_TIMEOUT_MS = 20000;

function loadVllm(protoDir) {
  const definition = protoLoader.loadSync(
    [path.join(protoDir, 'vllm_engine.proto'), path.join(protoDir, 'common.proto')],
    { ...LOADER_OPTIONS, includeDirs: [protoDir] });
  return grpc.loadPackageDefinition(definition).vllm.grpc.engine.VllmEngine;
}

function loadHealth(descriptorSetPath) {
  // A serialized FileDescriptorSet of grpc/health/v1/health.proto, written by the Python side
  // from grpcio-health-checking's compiled descriptor (the wheel ships no .proto file).
  const definition = protoLoader.loadFileDescriptorSetFromBuffer(
    fs.readFileSync(descriptorSetPath), LOADER_OPTIONS);
  return grpc.loadPackageDefinition(definition).grpc.health.v1.Health;
}

function toMetadata(pairs) {
  const metadata = new grpc.Metadata();
  for (const [key, value] of pairs) metadata.add(key, value);
  return metadata;
}

function deadline(ms) {
  return Date.now() + ms;
}

function failure(err) {
  return { code: err.code, details: err.details };
}

function unary(client, method, request, metadata) {
  return new Promise((resolve) => {
    client[method](request, metadata, { deadline: deadline(CALL_TIMEOUT_MS) }, (err, reply) => {
      resolve(err ? { error: failure(err) } : { reply });
    });
  });
}

// Reads a server stream to its end; `messages` holds what arrived before any error.
function serverStream(client, method, request, metadata, deadlineMs) {
  return new Promise((resolve) => {
    const messages = [];
    const startedAt = Date.now();
    const call = client[method](request, metadata, { deadline: deadline(deadlineMs) });
    call.on('data', (message) => messages.push(message));
    call.on('error', (err) => resolve({ messages, error: failure(err),
                                        elapsedMs: Date.now() - startedAt }));
    call.on('end', () => resolve({ messages, elapsedMs: Date.now() - startedAt }));
  });
}

function summarizeComplete(complete) {
  return {
    output_ids: complete.output_ids,
    finish_reason: complete.finish_reason,
    prompt_tokens: complete.prompt_tokens,
    completion_tokens: complete.completion_tokens,
    cached_tokens: complete.cached_tokens,
    index: complete.index,
  };
}

function summarizeGenerate(result) {
  const chunks = result.messages.filter((m) => m.response === 'chunk').map((m) => m.chunk);
  const completes = result.messages.filter((m) => m.response === 'complete').map((m) => m.complete);
  const last = result.messages[result.messages.length - 1];
  return {
    messages: result.messages.length,
    chunks: chunks.length,
    chunk_token_ids: chunks.flatMap((c) => c.token_ids),
    last_chunk_token_ids: chunks.length ? chunks[chunks.length - 1].token_ids : [],
    chunk_prompt_tokens: [...new Set(chunks.map((c) => c.prompt_tokens))],
    completes: completes.map(summarizeComplete),
    last_is_complete: last !== undefined && last.response === 'complete',
    error: result.error || null,
    elapsed_ms: result.elapsedMs,
  };
}

function generateRequest(id, promptIds, stream, sampling) {
  return {
    request_id: id,
    tokenized: { input_ids: promptIds },
    sampling_params: sampling,
    stream,
  };
}

async function runChecks(config) {
  const VllmEngine = loadVllm(config.protoDir);
  const client = new VllmEngine(config.address, grpc.credentials.createInsecure());
  const headers = () => toMetadata(config.metadata);
  const ids = config.promptIds;
  const tag = `grpc-js-${process.pid}`;
  const out = { grpc_js_version: require('@grpc/grpc-js/package.json').version };

  const unaryStyle = await serverStream(client, 'Generate',
    generateRequest(`${tag}-unary`, ids, false, { max_tokens: 8, ignore_eos: true }),
    headers(), CALL_TIMEOUT_MS);
  out.generate = summarizeGenerate(unaryStyle);

  const streamed = await serverStream(client, 'Generate',
    generateRequest(`${tag}-stream`, ids, true, { max_tokens: 16, ignore_eos: true }),
    headers(), CALL_TIMEOUT_MS);
  out.generate_stream = summarizeGenerate(streamed);

  const embed = await unary(client, 'Embed',
    { request_id: `${tag}-embed`, tokenized: { input_ids: ids } }, headers());
  out.embed = embed.error ? { error: embed.error } : {
    dim: embed.reply.embedding_dim,
    length: embed.reply.embedding.length,
    prompt_tokens: embed.reply.prompt_tokens,
    finite: embed.reply.embedding.every(Number.isFinite),
  };

  const info = await unary(client, 'GetModelInfo', {}, headers());
  out.model_info = info.error ? { error: info.error } : info.reply;

  const health = await unary(client, 'HealthCheck', {}, headers());
  out.health_check = health.error ? { error: health.error } : health.reply;

  const bad = await serverStream(client, 'Generate',
    generateRequest(`${tag}-bad`, ids, false, { max_tokens: 8, temperature: -1.0 }),
    headers(), CALL_TIMEOUT_MS);
  out.bad_sampling = summarizeGenerate(bad);

  const long = await serverStream(client, 'Generate',
    generateRequest(`${tag}-long`, ids, true, { max_tokens: config.longMaxTokens, ignore_eos: true }),
    headers(), config.deadlineMs);
  out.deadline = summarizeGenerate(long);
  out.deadline.tokens_before_deadline = out.deadline.chunk_token_ids.length;
  delete out.deadline.chunk_token_ids;  // only the count matters here
  delete out.deadline.last_chunk_token_ids;

  client.close();

  if (config.healthDescriptorSet) {
    const Health = loadHealth(config.healthDescriptorSet);
    const healthClient = new Health(config.address, grpc.credentials.createInsecure());
    out.grpc_health = {};
    for (const service of config.healthServices || ['']) {
      const reply = await unary(healthClient, 'Check', { service }, new grpc.Metadata());
      out.grpc_health[service] = reply.error ? { error: reply.error } : reply.reply.status;
    }
    healthClient.close();
  }
  return out;
}

runChecks(JSON.parse(process.argv[2])).then(
  (out) => { process.stdout.write(`${JSON.stringify(out)}\n`); },
  (err) => { process.stderr.write(`${err.stack || err}\n`); process.exit(1); });
