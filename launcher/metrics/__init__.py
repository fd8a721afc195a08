"""What an operator watches while a job runs: each agent's Prometheus metrics.

Each agent serves ``/metrics`` on ``--metrics-port`` (``recovery.metrics_port``; off by
default), bound to the agent's own address. Nothing here runs on a training thread:

- :mod:`.job_facts`: what the job store says (generation, committed step, failures and
  their causes), refreshed by the agent's loop every 5 s;
- :mod:`.node_progress`: what this node's ranks report in their progress files
  (``recovery.runtime.progress_report``), read when scraped, folded into goodput;
- :mod:`.recovery_events`: this node's ranks' ``recovery`` and ``straggler`` events,
  read from the run's ``events.jsonl`` as it grows;
- :mod:`.exporter`: the collector that turns the three into metric families at each
  scrape, and the HTTP server.

Metric names, labels and meanings: ``docs/guide/operations.md``.
"""
