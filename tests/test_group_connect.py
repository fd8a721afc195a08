"""A peer that dies while a generation's process group connects is the job's failure,
not the script's.

Under load, rank 1 of a job was SIGKILLed after it had published its gloo address for
generation 0 and before rank 0 connected to it. Rank 0's ``init_process_group`` then
raised gloo's own ``RuntimeError`` ("connectFullMesh failed ... Connection refused" or
"closed by peer"), which reached the script before its first step and stopped the job
as a bug in it (``test_user_errors.py::test_a_peer_killed_during_set_up_is_a_failure_
not_a_bug``, 1 in 1,123 under load). The same error from a collective was already a
peer failure (``recovery.process_group.works``); here the set-up gets the same rule.
The peer is a real process killed mid-connect; nothing is mocked.
"""

from __future__ import annotations

import datetime
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from recovery.common.causes import FailureCause, classify
from recovery.common.errors import CollectiveAborted
from recovery.generation.protocol import gen_prefix
from recovery.process_group.controller import Controller
from tests.recovery_harness import REPO, clean_env

pytestmark = pytest.mark.timeout(120)

#: The generation's group timeout: gloo either fails the connection to the dead peer at
#: once (refused) or waits this long for it, depending on which side of the pair
#: connects; both must end as the job's failure.
GROUP_TIMEOUT_S = 5.0

PEER = """
import datetime, sys, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, False,
                      timeout=datetime.timedelta(seconds=30))
dist.ProcessGroupGloo(dist.PrefixStore(sys.argv[2], store), 1, 2,
                      datetime.timedelta(seconds=30))
"""


def test_a_peer_killed_while_the_group_connects_is_a_peer_failure():
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=30),
                          wait_for_workers=False)
    ctl = Controller()
    ctl.configure(store, timeout_s=GROUP_TIMEOUT_S)
    group = ctl.create(SimpleNamespace(global_ranks_in_group=[0, 1], group_size=2,
                                       group_rank=0, group_id="0", timeout=None))
    prefix = f"{gen_prefix(0)}/pg/{group.bind_key}.0/cpu"
    keys_before = store.num_keys()
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(store.port), prefix],
                            cwd=REPO, env=clean_env())
    try:
        deadline = time.monotonic() + 60
        # Two keys: the peer's store connection's, then its gloo address.
        while store.num_keys() < keys_before + 2:
            assert peer.poll() is None and time.monotonic() < deadline, "peer never joined"
            time.sleep(0.05)
    finally:
        peer.send_signal(signal.SIGKILL)
        peer.wait()
    with pytest.raises(CollectiveAborted, match="connecting generation 0's process group") \
            as caught:
        ctl.activate(0)
    assert classify(caught.value, lambda: False) is FailureCause.PEER_FAILURE
    assert isinstance(caught.value.__cause__, RuntimeError)  # gloo's words are kept
