"""Who may call a server and what they may read: tenants and their tokens, bearer-token
authentication, access to store keys, and TLS.

It imports nothing else of `hapi.server`.
"""
