#!/usr/bin/env bash
# The same batch with XPK on an existing GKE cluster that has a v6e-16 (4x4) node pool.
# XPK writes the JobSet for you: one pod per host, the same command on each. The bucket is
# mounted at /data through GCS FUSE (`xpk storage attach`; flags as in XPK's README: check
# `xpk storage attach --help` for your XPK version). Replace CLUSTER, PROJECT, ZONE, IMAGE and
# BUCKET. Checked by tests/test_deploy.py; not run by this project.
#
# Before the first run:
# - The cluster needs GKE's Cloud Storage FUSE CSI driver, or the pods wait forever for the
#   /data mount. Create the cluster with it (`xpk cluster create ... --enable-gcsfuse-csi-driver`)
#   or turn it on for an existing cluster (step 0 below).
# - The pods reach the bucket through Workload Identity: a Kubernetes service account bound to a
#   Google service account that has access to the bucket (e.g. roles/storage.objectUser). See
#   the header of jobset-v6e-16.yaml and the GKE documentation on the Cloud Storage FUSE CSI driver.
# - The model weights (zai-org/CogVideoX1.5-5B, about 31 GB, "CogVideoX LICENSE": read it on the
#   model card first) go into the bucket once, from one machine, not from every pod at run time.
#   With the bucket mounted at /data on that machine (gcsfuse), or to a local folder followed by
#   `gcloud storage cp -r CogVideoX1.5-5B gs://BUCKET/models/`:
#     hf download zai-org/CogVideoX1.5-5B --local-dir /data/models/CogVideoX1.5-5B
#   The run then loads them with `--model /data/models/CogVideoX1.5-5B` and HF_HUB_OFFLINE=1, so
#   no pod contacts the Hub. (`--model` and `--preset` are mutually exclusive in the CLI;
#   TPUPEDIA_PRESET=full still selects bf16 and the real TPU devices.)
set -euo pipefail

# Step 0 (optional, once): enable the GCS FUSE CSI driver on a cluster created without it.
# gcloud container clusters update CLUSTER --update-addons GcsFuseCsiDriver=ENABLED

# --size is required by XPK for --type=gcsfuse: the size in GB that XPK records for the volume
# (a Cloud Storage bucket has no fixed size).
xpk storage attach tpupedia-data --type=gcsfuse --bucket=BUCKET --mount-point=/data --auto-mount=true \
  --readonly=false --size=64 --cluster CLUSTER --project PROJECT --zone ZONE
xpk workload create \
  --cluster CLUSTER --project PROJECT --zone ZONE \
  --workload tpupedia-cogvideox-batch \
  --tpu-type v6e-16 \
  --num-slices 1 \
  --docker-image IMAGE \
  --command "TPUPEDIA_PRESET=full HF_HUB_OFFLINE=1 tpupedia generate cogvideox --model /data/models/CogVideoX1.5-5B --prompts /data/prompts.txt --outdir /data/out --compilation-cache /data/jax-cache"
