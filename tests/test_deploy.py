"""The deployment files for a v6e-16 slice (notebook 10) say what the slice is and run the batch
command the CLI accepts."""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

from tpupedia import cli, hardware

DEPLOY = Path(__file__).resolve().parents[1] / "docs" / "deploy"
SLICE = hardware.parse_topology("v6e:4x4")  # a v6e-16


def _generate_args(command: list[str]) -> list[str]:
    assert command[:3] == ["tpupedia", "generate", "cogvideox"], command
    return command[1:]


def test_jobset_describes_a_v6e_16_and_runs_the_batch():
    doc = yaml.safe_load((DEPLOY / "jobset-v6e-16.yaml").read_text())
    assert doc["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and doc["kind"] == "JobSet"
    (job,) = doc["spec"]["replicatedJobs"]
    spec = job["template"]["spec"]
    assert spec["parallelism"] == spec["completions"] == SLICE.hosts == 4  # one pod per host
    pod = spec["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
                                   "cloud.google.com/gke-tpu-topology": "4x4"}
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["google.com/tpu"] == SLICE.num_chips // SLICE.hosts == 4
    assert {e["name"]: e["value"] for e in container["env"]}["TPUPEDIA_PRESET"] == "full"
    args = cli.build_parser().parse_args(_generate_args(container["command"]))
    assert args.prompts and args.outdir and args.compilation_cache.startswith("/data/")
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert all(p.startswith(tuple(mounts)) for p in (args.prompts, args.outdir, args.compilation_cache))
    assert pod["volumes"][0]["csi"]["driver"] == "gcsfuse.csi.storage.gke.io"


def test_xpk_script_targets_the_same_slice_and_command():
    text = (DEPLOY / "xpk-v6e-16.sh").read_text()
    create = next(line for line in text.replace("\\\n", " ").splitlines() if line.startswith("xpk workload create"))
    words = shlex.split(create)
    flags = {w: words[i + 1] for i, w in enumerate(words) if w.startswith("--") and i + 1 < len(words)}
    assert flags["--tpu-type"] == SLICE.accelerator_type == "v6e-16" and flags["--num-slices"] == "1"
    env, *command = shlex.split(flags["--command"])
    assert env == "TPUPEDIA_PRESET=full"
    args = cli.build_parser().parse_args(_generate_args(command))
    assert args.prompts.startswith("/data/") and args.outdir.startswith("/data/")
    assert "--mount-point=/data" in text
