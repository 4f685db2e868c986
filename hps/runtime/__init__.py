"""Runtime helpers every layer may use: background threads, retries, breakers, compiled code."""
