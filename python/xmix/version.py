"""The package's version, in a module of its own so that every layer can name it without
importing the package's face (xmix/__init__.py hands it on)."""

__version__ = "0.1.0"
