"""`forge demo`: the whole loop (harness → sidecar → collector → veRL update → publish → next round) on one machine."""
