"""The model out of a swarm: `swarmd export` and `swarmd sample` (docs/architecture.md)."""
