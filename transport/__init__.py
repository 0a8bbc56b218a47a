"""The wire: a libp2p host for asyncio programs, tensor codecs and the framed stream protocol.

This package knows nothing about stages or training and never imports ``swarmd``.
"""
