from torchherd.cli import entry

entry()
