import sys
from pathlib import Path

# test helpers (daemon_harness, transport_peer) are imported as plain modules
sys.path.insert(0, str(Path(__file__).parent))
