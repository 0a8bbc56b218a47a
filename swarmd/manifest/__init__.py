"""The swarm manifest: what every peer of a swarm shares, content-addressed (docs/manifest.md).

``document`` (the typed document, its canonical bytes and hash; pure), ``settle`` (take the
swarm's settings or refuse naming what differs; pure), ``wire`` (the protocol's messages;
pure), ``local`` (from a configuration, kept and adopted in the home), ``service`` (serving and
fetching over ``/swarmd/manifest/1``), ``join`` (a peer's configuration settled before it
serves).
"""
