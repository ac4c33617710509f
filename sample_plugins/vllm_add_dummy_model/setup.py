# Ported from vLLM's tests/plugins/vllm_add_dummy_model/setup.py: only the entry-point group changed
# ("vllm.general_plugins" -> "pluginhost.plugins").

from setuptools import setup

setup(
    name="vllm_add_dummy_model",
    version="0.1",
    packages=["vllm_add_dummy_model"],
    entry_points={"pluginhost.plugins": ["register_dummy_model = vllm_add_dummy_model:register"]},
)
