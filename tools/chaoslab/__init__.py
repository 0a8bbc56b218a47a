"""The parts of tools/chaos.py: the plan (pure), the lab swarm, the faults, the hostile peer."""
