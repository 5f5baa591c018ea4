"""Test session set-up: 8 simulated CPU devices, chosen before anything initialises JAX."""

import os
import warnings

os.environ["TPUPEDIA_PRESET"] = "tiny"  # tests assert tiny-preset behaviour

from tpupedia import devices

devices.simulate_cpu_devices(8)
warnings.filterwarnings("ignore", message="Explicitly requested dtype")
