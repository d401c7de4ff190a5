"""Request sessions: one request from parse to its end, admission, the Encode client, readiness."""
