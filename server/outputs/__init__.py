"""What a run leaves and shows: metrics and report.md, the checkpoint, the progress line, the live status page and
its Prometheus metrics. Uses ``server.engine``."""
