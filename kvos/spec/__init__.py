"""Speculative decoding's pure-Python side: proposers that need no model (n-gram prompt lookup)
and the counters of proposals and acceptances. The verification (rejection sampling) is the
worker's (``kvos.worker.spec_verify``); the scheduler only sees a request's draft tokens."""
