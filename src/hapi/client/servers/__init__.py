"""The trainer's side of the one server protocol (`Server`).

`Connection` speaks it to a `hapi serve` over Arrow Flight; `MemorySource` implements it in
memory for tests; `LocalSource` computes chunks on the trainer itself (a hybrid's share).
Above them: the session on every server a job uses (`sessions`), the set of servers with
their health (`pool`), and retrying with backoff (`retry`). Reads only `config`.
"""
