"""The test session's environment (tests/conftest.py): 8 emulated devices whatever XLA_FLAGS held."""
import jax

from conftest import with_host_device_count


def test_device_count_flag_is_appended_replaced_or_kept():
    assert with_host_device_count(None) == "--xla_force_host_platform_device_count=8"
    assert with_host_device_count("--xla_cpu_enable_fast_math=false") == \
        "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=8"
    assert with_host_device_count("--xla_force_host_platform_device_count=8") == \
        "--xla_force_host_platform_device_count=8"
    assert with_host_device_count("--a=1 --xla_force_host_platform_device_count=2 --b") == \
        "--a=1 --b --xla_force_host_platform_device_count=8"


def test_session_has_eight_devices():
    assert len(jax.devices()) >= 8
