"""The Kubernetes manifests (``examples/kubernetes/``), checked offline: no cluster runs
here. Each document is validated strictly against the Kubernetes 1.33 API schema
(``kubernetes-validate``, from the package registry). The Job's command line is then
parsed by ``checkpointless run``'s own parser, as each pod would run it, and the
manifest's numbers are checked against each other and against the exit statuses.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from launcher.run_args import UsageError, add_arguments, from_namespace
from replication import contract
from tests.recovery_harness import REPO

MANIFESTS = REPO / "examples" / "kubernetes"
K8S_VERSION = "1.33"


def _docs(name: str) -> list[dict]:
    return list(yaml.safe_load_all((MANIFESTS / name).read_text()))


def _job() -> dict:
    return next(d for d in _docs("train.yaml") if d["kind"] == "Job")


@pytest.mark.parametrize("name", ["train.yaml", "etcd.yaml"])
def test_every_document_validates_against_the_api_schema(name):
    docs = _docs(name)
    assert docs
    for doc in docs:
        assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True) == K8S_VERSION


def test_the_validator_rejects_a_misspelled_field():
    job = _job()
    job["spec"]["backoffLimitPerIndx"] = 0
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)


def _pod_args(index: int, tmp_path: Path):
    """The trainer's command line as pod ``index`` runs it: Kubernetes' $(VAR)
    expansion done, the script replaced by a local file (the image's is not here), and
    ``gpu`` workers per node counted as on an 8-GPU node (this host has none)."""
    container = _job()["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["checkpointless", "run"]
    argv = [re.sub(r"\$\(JOB_UID\)", "0f3c-uid", a) for a in container["args"]]
    assert "--nproc-per-node=gpu" in argv
    argv = ["--nproc-per-node=8" if a == "--nproc-per-node=gpu" else a for a in argv]
    script = next(a for a in argv if a.endswith(".py"))
    local = tmp_path / "train.py"
    local.write_text("")
    argv = [str(local) if a == script else a for a in argv]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return from_namespace(parser, parser.parse_args(argv),
                          {"JOB_COMPLETION_INDEX": str(index)})


def test_each_pod_takes_its_completion_index_as_its_node_rank(tmp_path):
    spec = _job()["spec"]
    pods = [_pod_args(i, tmp_path) for i in range(spec["completions"])]
    assert [p.node_rank for p in pods] == list(range(spec["completions"]))
    nnodes = pods[0].nnodes
    assert [p.is_spare_node for p in pods] == [i >= nnodes for i in range(len(pods))]
    assert pods[0].placement == ("checkpointless: Kubernetes Indexed Job: pod index 0, "
                                 "node rank 0 of 2 training node(s) (training)")
    assert pods[-1].placement.endswith("(spare)")
    # the numbers agree: spare pods = failed indexes allowed; success = training nodes
    assert spec["completions"] == spec["parallelism"] == nnodes + spec["maxFailedIndexes"]
    assert spec["successPolicy"]["rules"] == [{"succeededCount": nnodes}]
    assert spec["backoffLimitPerIndex"] == 0
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    # every pod names the same job and the etcd members etcd.yaml creates
    assert {p.rdzv_id for p in pods} == {"checkpointless-train-0f3c-uid"}
    etcd = next(d for d in _docs("etcd.yaml") if d["kind"] == "StatefulSet")
    members = {(f"{etcd['metadata']['name']}-{i}.{etcd['spec']['serviceName']}", 2379)
               for i in range(etcd["spec"]["replicas"])}
    assert pods[0].uses_etcd and set(pods[0].etcd_endpoints) == members


def test_the_failure_policy_matches_the_exit_statuses():
    rules = _job()["spec"]["podFailurePolicy"]["rules"]
    by_code = {code: r["action"] for r in rules if "onExitCodes" in r
               for code in r["onExitCodes"]["values"]}
    assert by_code == {contract.EXIT_SCRIPT_ERROR: "FailJob", contract.EXIT_RETRY: "FailJob"}
    lost = [r for r in rules if "onPodConditions" in r]
    assert lost == [{"action": "FailIndex", "onPodConditions": [
        {"type": "DisruptionTarget", "status": "True"}]}]


def test_a_flag_wins_over_the_index_and_a_bad_index_is_one_line(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    got = from_namespace(parser, parser.parse_args(["--nnodes", "2", "--node-rank", "1",
                                                    str(script)]),
                         {"JOB_COMPLETION_INDEX": "0"})
    assert got.node_rank == 1
    with pytest.raises(UsageError, match=r"JOB_COMPLETION_INDEX='x' is not a pod index"):
        from_namespace(parser, parser.parse_args([str(script)]), {"JOB_COMPLETION_INDEX": "x"})
