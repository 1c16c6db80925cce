"""Memory techniques of fitune's runner, one module each (chunked loss, ...); each has CPU parity tests."""
