"""`kvswitch bench`: workloads, targets (kvswitch, round robin, random, SMG, oracle), runner,
reports. See `kvswitch.bench.cli`."""
