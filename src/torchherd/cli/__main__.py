from torchherd.cli.dispatch import entry

entry()
