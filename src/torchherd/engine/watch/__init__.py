"""Watches on a running job, used by every backend's job: the hang watch and the
straggler watch (the recovering runner acts on what they find)."""
