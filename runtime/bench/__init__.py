"""`vtool bench`: a load generator that is a client of an OpenAI-compatible server. No room of the
runtime library imports it; it only speaks HTTP (and may start a local `vtool serve`)."""
