"""Circuit relay v2 and DCUtR hole punching for ``transport.host.Host`` (see ``node``)."""
