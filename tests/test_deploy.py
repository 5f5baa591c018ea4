"""The deployment files for a v6e-16 slice (notebook `beyond_one_host`) say what the slice is, mount the bucket
the way GKE and XPK require, and run the batch command the CLI accepts on weights copied into
the bucket once; the guides name the model licences."""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

from tpupedia import cli, hardware

DOCS = Path(__file__).resolve().parents[1] / "docs"
DEPLOY = DOCS / "deploy"
SLICE = hardware.parse_topology("v6e:4x4")  # a v6e-16
_ENV_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def _generate_args(command: list[str]) -> list[str]:
    assert command[:3] == ["tpupedia", "generate", "cogvideox"], command
    return command[1:]


def _split_env(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """Leading `NAME=VALUE` words of a shell command, as a dict, and the command after them."""
    env = {}
    while words and _ENV_WORD.match(words[0]):
        name, value = words[0].split("=", 1)
        env[name] = value
        words = words[1:]
    return env, words


def _assert_runs_on_the_bucket_copy(command: list[str]) -> None:
    """The batch loads the weights from the bucket (`--model /data/models/...`), not by preset."""
    assert "--preset" not in command, command  # --preset and --model are mutually exclusive
    args = cli.build_parser().parse_args(_generate_args(command))
    assert args.preset is None
    assert args.model and args.model.startswith("/data/models/") and len(args.model) > len("/data/models/")


def _jobset_pod() -> dict:
    doc = yaml.safe_load((DEPLOY / "jobset-v6e-16.yaml").read_text())
    (job,) = doc["spec"]["replicatedJobs"]
    return job["template"]["spec"]["template"]


def _xpk_lines() -> list[str]:
    """The script's commands, continuation lines joined, comments left out."""
    text = (DEPLOY / "xpk-v6e-16.sh").read_text()
    return [line for line in text.replace("\\\n", " ").splitlines() if not line.lstrip().startswith("#")]


def _xpk_create_flags() -> dict[str, str]:
    return _flags(shlex.split(next(line for line in _xpk_lines() if line.startswith("xpk workload create"))))


def _flags(words: list[str]) -> dict[str, str]:
    """`--name value` and `--name=value` flags of a command line."""
    flags = {}
    for i, w in enumerate(words):
        if w.startswith("--") and "=" in w:
            name, value = w.split("=", 1)
            flags[name] = value
        elif w.startswith("--") and i + 1 < len(words):
            flags[w] = words[i + 1]
    return flags


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
    assert all(p.startswith(tuple(mounts)) for p in (args.prompts, args.outdir, args.compilation_cache, args.model))
    assert pod["volumes"][0]["csi"]["driver"] == "gcsfuse.csi.storage.gke.io"


def test_jobset_mounts_the_bucket_with_workload_identity_and_reads_weights_offline():
    template = _jobset_pod()
    pod = template["spec"]
    # GKE injects the GCS FUSE sidecar only into pods with this annotation.
    assert template["metadata"]["annotations"]["gke-gcsfuse/volumes"] == "true"
    # The Kubernetes service account bound through Workload Identity to one with bucket access.
    assert isinstance(pod.get("serviceAccountName"), str) and pod["serviceAccountName"].strip()
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["HF_HUB_OFFLINE"] == "1" and env["TPUPEDIA_PRESET"] == "full"
    assert "HF_HOME" not in env  # no shared Hugging Face cache on FUSE
    _assert_runs_on_the_bucket_copy(container["command"])


def test_xpk_script_targets_the_same_slice_and_command():
    flags = _xpk_create_flags()
    assert flags["--tpu-type"] == SLICE.accelerator_type == "v6e-16" and flags["--num-slices"] == "1"
    env, command = _split_env(shlex.split(flags["--command"]))
    assert env == {"TPUPEDIA_PRESET": "full", "HF_HUB_OFFLINE": "1"}
    args = cli.build_parser().parse_args(_generate_args(command))
    assert args.prompts.startswith("/data/") and args.outdir.startswith("/data/")
    _assert_runs_on_the_bucket_copy(command)
    assert "--mount-point=/data" in (DEPLOY / "xpk-v6e-16.sh").read_text()


def test_xpk_storage_attach_has_the_flags_xpk_requires():
    text = (DEPLOY / "xpk-v6e-16.sh").read_text()
    (attach,) = [line for line in _xpk_lines() if line.startswith("xpk storage attach")]
    flags = _flags(shlex.split(attach))
    assert flags["--type"] == "gcsfuse"
    assert flags["--mount-point"] == "/data"
    assert re.fullmatch(r"[0-9]+", flags.get("--size", "")) and int(flags["--size"]) > 0  # XPK: "--size is required"
    assert "--enable-gcsfuse-csi-driver" in text  # the cluster needs the GCS FUSE CSI driver
    # The one-time weight download is written out, into the folder the run reads.
    _, command = _split_env(shlex.split(_xpk_create_flags()["--command"]))
    model_dir = command[command.index("--model") + 1]
    assert f"--local-dir {model_dir}" in text and "hf download zai-org/CogVideoX1.5-5B" in text


def test_guides_name_the_model_licences():
    for page in ("guides/cogvideox-tpu-vm.md", "guides/trillium-gke.md"):
        text = " ".join((DOCS / page).read_text().split())
        assert "CogVideoX LICENSE" in text, page
        assert "Tencent Hunyuan Community License" in text, page
        assert "Apache-2.0" in text, page
        assert all(place in text for place in ("European Union", "United Kingdom", "South Korea")), page


_HUB_CLI = re.compile(r"(?:hf|huggingface-cli) \S")
_INLINE_CODE = re.compile(r"(?<!`)`([^`]+)`(?!`)")


def _hub_commands(path: Path) -> list[str]:
    """Hugging Face CLI commands a page or deploy file gives: code lines (comments included) and inline code."""
    text = path.read_text()
    lines = [line.strip().lstrip("#").strip() for line in text.splitlines()]
    spans = _INLINE_CODE.findall(" ".join(text.split()))
    return [c for c in lines + spans if _HUB_CLI.match(c)]


def test_hub_commands_are_ones_the_pinned_huggingface_hub_installs():
    """`huggingface_hub` installs `hf` (no `huggingface-cli`): every Hub command the docs and deploy files give runs
    that program, and each `hf download` uses only flags its `--help` lists."""
    hub = importlib.metadata.distribution("huggingface_hub")
    scripts = {ep.name for ep in hub.entry_points if ep.group == "console_scripts"}
    assert "hf" in scripts and "huggingface-cli" not in scripts, (hub.version, scripts)
    usage = subprocess.run([sys.executable, "-c", "import sys; from huggingface_hub.cli.hf import main; "
                            "sys.argv = ['hf', 'download', '--help']; main()"],
                           capture_output=True, text=True, check=True).stdout
    known = set(re.findall(r"--[a-z][a-z-]*", usage))
    paths = [*DOCS.rglob("*.md"), *DEPLOY.glob("*.sh"), *DEPLOY.glob("*.yaml")]
    commands = [(path, c) for path in paths for c in _hub_commands(path)]
    downloads = [(path, shlex.split(c)) for path, c in commands if c.startswith("hf download ")]
    assert len(downloads) >= 6, commands  # the guides, the deploy files, the knowledge base, both editions
    for path, command in commands:
        assert command.split()[0] in scripts, (path, command)
    for path, words in downloads:
        assert not words[2].startswith("-"), (path, words)  # REPO_ID first
        assert {w.split("=")[0] for w in words if w.startswith("--")} <= known, (path, words)
