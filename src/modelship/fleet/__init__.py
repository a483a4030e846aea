"""The local serving fleet: replicas supervised and autoscaled behind one gateway.

`local.py` is the composition root of `modelship up` (gateway service, endpoint pool,
supervisor, the release plan); `supervisor.py` starts, health-checks, scales and drains
replica processes; `releases.py` is the release plan on storage (canary, promote,
rollback). It uses `gateway/` (routing, the pool) and `autoscale/` (the pure policy);
neither of them imports it.
"""
