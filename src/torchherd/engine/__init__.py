"""The engine: launch, supervise and tear down a job (``launch``, ``job``), detached
runs (``detach``), and the typed events it reports (``events``). It never prints."""
