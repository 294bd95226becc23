"""Recovery: the attempts of a run with retries (``runner``) and their policy (``policy``),
the hang watch (``hang``), the straggler watch (``straggler``), the checkpoint's staging
(``staging``) and replication, and the background controller of a detached run
(``background``)."""
