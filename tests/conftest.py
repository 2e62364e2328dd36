import os
import sys

# Tests never reach a model hub: everything they use is built here or fetched from PyPI/npm.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))
