"""The diag agent: a per-node sidecar that watches the ranks' op journals and acts on hangs."""
