"""``checkpointless run`` reads its place from a Slurm step's variables (flags win).

The variables are the ones a real ``srun`` set (tests/test_slurm.py runs real Slurm);
here each mapping is checked without a cluster, including the mistakes: the batch
script instead of srun, several tasks per node, a spare count that leaves no node.
"""

from __future__ import annotations

import argparse

import pytest

from launcher.run_args import UsageError, add_arguments, from_namespace
from launcher.slurm_env import SlurmError, expand_hostlist, tasks_per_node
from tests.recovery_harness import REPO

SCRIPT = str(REPO / "examples" / "train_gpt.py")


def _step(node: str = "n1", nodes: str = "n[0-2]", **extra: str) -> dict[str, str]:
    """What srun --ntasks-per-node=1 gave a task on ``node`` (job 4242, step 0)."""
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": nodes,
            "SLURM_JOB_NODELIST": nodes, "SLURMD_NODENAME": node,
            "SLURM_STEP_TASKS_PER_NODE": f"1(x{len(expand_hostlist(nodes))})",
            "SLURM_NNODES": str(len(expand_hostlist(nodes))), **extra}


def _parse(argv: list[str], env: dict[str, str]):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return from_namespace(parser, parser.parse_args([*argv, SCRIPT]), env)


@pytest.mark.parametrize("text, names", [
    ("n0", ["n0"]),
    ("n[0-2]", ["n0", "n1", "n2"]),
    ("gpu[08-10],login1", ["gpu08", "gpu09", "gpu10", "login1"]),
    ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
    ("a[1,3-4]b", ["a1b", "a3b", "a4b"]),
])
def test_host_lists_expand_as_slurm_writes_them(text, names):
    assert expand_hostlist(text) == names


@pytest.mark.parametrize("bad", ["n[0-2", "n[a-b]", "n0]"])
def test_an_unreadable_host_list_is_one_clear_error(bad):
    with pytest.raises(SlurmError, match="cannot read the Slurm host list"):
        expand_hostlist(bad)


def test_tasks_per_node_reads_the_repeat_form():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]


def test_a_step_gives_node_rank_node_count_job_id_and_endpoint():
    args = _parse([], _step("n1"))
    assert (args.node_rank, args.nnodes, args.rdzv_id) == (1, 3, "slurm-4242")
    assert (args.host, args.port) == ("n0", 29400 + 4242 % 1000)
    assert args.placement.startswith("checkpointless: Slurm job 4242 step 0: 3 node(s), "
                                     "3 training and 0 spare")


def test_spare_nodes_are_the_last_of_the_list():
    args = _parse(["--spare-nodes", "1"], _step("n2"))
    assert (args.nnodes, args.node_rank, args.is_spare_node) == (2, 2, True)
    assert "2 training and 1 spare" in args.placement


def test_flags_given_win_over_the_step():
    args = _parse(["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "h:1234",
                   "--rdzv-id", "mine"], _step("n1"))
    assert (args.nnodes, args.node_rank, args.host, args.port, args.rdzv_id) == \
        (2, 0, "h", 1234, "mine")


def test_a_requeued_job_gets_a_new_job_id():
    assert _parse([], _step("n0", SLURM_RESTART_COUNT="2")).rdzv_id == "slurm-4242-r2"


def test_with_etcd_no_endpoint_is_derived():
    args = _parse(["--rdzv-backend", "etcd", "--rdzv-endpoint", "e1:2379"], _step("n0"))
    assert args.uses_etcd and args.etcd_endpoints == (("e1", 2379),)
    assert args.rdzv_id == "slurm-4242" and "job store in etcd" in args.placement


def test_outside_slurm_nothing_changes():
    args = _parse([], {})
    assert (args.nnodes, args.node_rank, args.rdzv_id, args.placement) == (1, 0, "none", "")


def test_a_one_node_batch_script_runs_as_a_single_node():
    args = _parse(["--standalone"], {"SLURM_JOB_ID": "7", "SLURM_NNODES": "1"})
    assert args.standalone and args.placement == ""
    assert _parse([], {"SLURM_JOB_ID": "7", "SLURM_NNODES": "1"}).placement == ""


@pytest.mark.parametrize("argv, env, says", [
    ([], {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "3"},
     "this is Slurm job 7's batch script, on one of its 3 nodes: start one agent per node "
     "with 'srun --ntasks-per-node=1"),
    ([], _step("n0", SLURM_STEP_TASKS_PER_NODE="2(x3)"),
     "runs 2(x3) tasks per node: checkpointless run is one agent per node"),
    ([], _step("n9"), "this node ('n9') is not in the step's node list 'n[0-2]'"),
    (["--spare-nodes", "3"], _step("n0"), "--spare-nodes 3: the step has 3 node(s)"),
    (["--nnodes", "3", "--spare-nodes", "1"], _step("n0"),
     "--nnodes 3 and --spare-nodes 1 do not add up to the step's 3 nodes"),
    (["--spare-nodes", "1"], {}, "--spare-nodes is read in a Slurm job step only"),
])
def test_mistakes_get_one_clear_line(argv, env, says):
    with pytest.raises(UsageError) as caught:
        _parse(argv, env)
    assert says in str(caught.value) and "\n" not in str(caught.value)
