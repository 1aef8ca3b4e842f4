{{/* The EPP's name: its Deployment, Service and InferencePool endpointPickerRef. */}}
{{- define "kvswitch.name" -}}
{{- printf "%s-epp" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Several EPPs behind the chart's own Envoys (standalone, replicas > 1): a StatefulSet whose
pods' stable DNS names are the EPP addresses Envoy lists and each EPP's --replica-name. */}}
{{- define "kvswitch.severalEpps" -}}
{{- if and (eq .Values.mode "standalone") (gt (int .Values.router.epp.replicas) 1) -}}true{{- end -}}
{{- end -}}

{{/* Gateway mode: the EPP serves ext_proc over TLS, as upstream's EPP does and GAIE gateways
expect, unless router.epp.flags.secure-serving (upstream's flag, read here) is false. */}}
{{- define "kvswitch.gatewayTls" -}}
{{- if eq .Values.mode "gateway" -}}
{{- $flag := index (.Values.router.epp.flags | default dict) "secure-serving" -}}
{{- if or (kindIs "invalid" $flag) (ne (toString $flag) "false") -}}true{{- end -}}
{{- end -}}
{{- end -}}

{{/* The headless Service naming each EPP pod of the StatefulSet. */}}
{{- define "kvswitch.peersName" -}}
{{- printf "%s-peers" (include "kvswitch.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The DNS suffix of an EPP pod's address: `POD.<this>:PORT`. */}}
{{- define "kvswitch.eppDomain" -}}
{{- printf "%s.%s.svc" (include "kvswitch.peersName" .) .Release.Namespace -}}
{{- end -}}

{{- define "kvswitch.poolName" -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvswitch.engineName" -}}
{{- printf "%s-engine" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvswitch.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvswitch.name" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvswitch.labels" -}}
app.kubernetes.io/name: kvswitch
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvswitch.selectorLabels" -}}
app.kubernetes.io/name: kvswitch
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: epp
{{- end -}}

{{- define "kvswitch.image" -}}
{{- printf "%s/%s:%s" .Values.image.registry .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "kvswitch.appProtocol" -}}
{{- if eq .Values.router.modelServers.protocol "grpc" -}}kubernetes.io/h2c{{- else -}}http{{- end -}}
{{- end -}}

{{- define "kvswitch.targetPort" -}}
{{- (index .Values.router.modelServers.targetPorts 0).number -}}
{{- end -}}

{{/* TLS: where the Secret is mounted, and the name every client verifies. */}}
{{- define "kvswitch.tlsDir" -}}/etc/kvswitch-tls{{- end -}}

{{- define "kvswitch.tlsServerName" -}}
{{- .Values.tls.serverName | default (printf "%s-pool.%s.svc" (include "kvswitch.poolName" .) .Release.Namespace) -}}
{{- end -}}

{{/* `kvswitch` flags to serve mTLS with the Secret. */}}
{{- define "kvswitch.tlsServerArgs" -}}
- --tls-cert={{ include "kvswitch.tlsDir" . }}/tls.crt
- --tls-key={{ include "kvswitch.tlsDir" . }}/tls.key
- --tls-handshake-timeout={{ .Values.tls.handshakeTimeout }}
{{- end -}}

{{/* `--PREFIX-tls-*` flags (prefix: .prefix) to call a server with the Secret (mTLS). */}}
{{- define "kvswitch.tlsClientArgs" -}}
- --{{ .prefix }}-tls-ca={{ include "kvswitch.tlsDir" .root }}/ca.crt
- --{{ .prefix }}-tls-cert={{ include "kvswitch.tlsDir" .root }}/tls.crt
- --{{ .prefix }}-tls-key={{ include "kvswitch.tlsDir" .root }}/tls.key
- --{{ .prefix }}-tls-sni={{ include "kvswitch.tlsServerName" .root }}
{{- end -}}

{{/* Fails the render on values that cannot work, naming the value. */}}
{{- define "kvswitch.validate" -}}
{{- if not (has .Values.mode (list "standalone" "gateway")) -}}
{{- fail (printf "mode: expected standalone or gateway, got %q" .Values.mode) -}}
{{- end -}}
{{- if not (has .Values.router.modelServers.protocol (list "grpc" "http")) -}}
{{- fail (printf "router.modelServers.protocol: expected grpc or http, got %q" .Values.router.modelServers.protocol) -}}
{{- end -}}
{{- if not .Values.router.modelServers.matchLabels -}}
{{- fail "router.modelServers.matchLabels: at least one label is required" -}}
{{- end -}}
{{- if not .Values.router.modelServers.targetPorts -}}
{{- fail "router.modelServers.targetPorts: at least one port is required" -}}
{{- end -}}
{{- if not (has .Values.provider.name (list "none" "gke" "istio")) -}}
{{- fail (printf "provider.name: expected none, gke or istio, got %q" .Values.provider.name) -}}
{{- end -}}
{{- if and .Values.router.frontend.enabled (ne .Values.mode "standalone") -}}
{{- fail "router.frontend.enabled: the frontend runs in standalone mode only" -}}
{{- end -}}
{{- if and .Values.router.frontend.enabled (ne .Values.router.modelServers.protocol "grpc") -}}
{{- fail "router.frontend.enabled: the frontend needs a grpc pool" -}}
{{- end -}}
{{- if and (hasKey (.Values.router.epp.flags | default dict) "secure-serving") (ne .Values.mode "gateway") -}}
{{- fail "router.epp.flags.secure-serving: gateway mode only (standalone: tls.secretName and tls.epps)" -}}
{{- end -}}
{{- if lt (int .Values.router.epp.replicas) 1 -}}
{{- fail (printf "router.epp.replicas: expected at least 1, got %v" .Values.router.epp.replicas) -}}
{{- end -}}
{{- if and .Values.modelServers.enabled (not (has .Values.modelServers.kind (list "simulated" "vllm"))) -}}
{{- fail (printf "modelServers.kind: expected simulated or vllm, got %q" .Values.modelServers.kind) -}}
{{- end -}}
{{- end -}}
