"""Recovery: the attempts of a run with retries (``runner``) and their policy (``policy``),
the checkpoint's replication, and the background controller of a detached run
(``background``). It sits above the backends and drives them through ``engine.backend``;
the hang and straggler watches are ``engine.watch``'s, the checkpoint's staging
``engine.prepare.staging``."""
