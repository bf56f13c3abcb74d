"""XLA:CPU flags that make the test suite's compiles fast (conftest.py says why and what they
keep). Test processes get them with 8 virtual devices; a test that starts a script as a user
would (one device) passes `FAST_COMPILE` alone."""

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
