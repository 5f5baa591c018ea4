#!/usr/bin/env bash
# The same batch with XPK on an existing GKE cluster that has a v6e-16 (4x4) node pool.
# XPK writes the JobSet for you: one pod per host, the same command on each. The bucket is
# mounted at /data through GCS FUSE (`xpk storage attach`; flags as in XPK's README: check
# `xpk storage attach --help` for your XPK version). Replace CLUSTER, PROJECT, ZONE, IMAGE and
# BUCKET. Checked by tests/test_deploy.py; not run by this project.
set -euo pipefail
xpk storage attach tpupedia-data --type=gcsfuse --bucket=BUCKET --mount-point=/data --auto-mount=true \
  --readonly=false --cluster CLUSTER --project PROJECT --zone ZONE
xpk workload create \
  --cluster CLUSTER --project PROJECT --zone ZONE \
  --workload tpupedia-cogvideox-batch \
  --tpu-type v6e-16 \
  --num-slices 1 \
  --docker-image IMAGE \
  --command "TPUPEDIA_PRESET=full tpupedia generate cogvideox --prompts /data/prompts.txt --outdir /data/out --compilation-cache /data/jax-cache"
