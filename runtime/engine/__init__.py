"""The engine: requests, the scheduler, the KV blocks and cache, the prefix cache, the model runner and
output processing, meeting through the per-step types in engine/step_types.py."""
