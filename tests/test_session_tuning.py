"""``harness.gate.session_tuning``: the profile chosen against a real pytest config (with and
without hypothesis's own plugin), the derandomized profiles' settings, the environment
unset, and an unknown profile's one line. In-process, milliseconds a test."""

from __future__ import annotations

import pytest

from harness.gate import session_tuning

pytestmark = pytest.mark.host  # pytest configurations and hypothesis profiles: no device


def _parse(pytester, *args):
    """A pytest config of this session's device source (``--devices``): JAX is already
    up, and the harness refuses a config that asks for other devices (the default 8,
    on a one-chip or ``--devices 1`` session)."""
    import jax

    source = "real" if jax.default_backend() != "cpu" else str(jax.device_count())
    return pytester.parseconfig("--devices", source, *args)


@pytest.fixture
def settings(monkeypatch):
    """hypothesis's settings, the loaded profile restored afterwards; none of the
    variables that choose a profile set."""
    from hypothesis import settings

    for name in ("CI", "HYPOTHESIS_PROFILE", "POSTTRAIN_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    name = settings.get_current_profile_name()
    yield settings
    settings.load_profile(name)


@pytest.mark.parametrize(("ci", "profile"), [(None, "dev"), ("true", "ci")])
def test_the_default_profile_without_a_device_variable(settings, monkeypatch, ci, profile):
    """With POSTTRAIN_DEVICES unset (a plain ``pytest`` outside the harness) the default
    is dev, or ci under CI, not an error."""
    if ci:
        monkeypatch.setenv("CI", ci)
    assert session_tuning.default_profile() == profile


@pytest.mark.parametrize("name", ["ci", "chip"])
def test_the_derandomized_profiles_print_the_blob_of_a_failure(settings, pytester, name):
    """ci and chip reproduce a failure from its printed blob (``@reproduce_failure``):
    derandomized, they keep no database to replay it from."""
    session_tuning.load_hypothesis_profile(_parse(pytester))
    profile = settings.get_profile(name)
    assert profile.print_blob is True and profile.database is None and profile.derandomize


def test_hypothesis_own_option_wins_over_the_environment(settings, pytester, monkeypatch):
    """``--hypothesis-profile dev`` is hypothesis's to load: a HYPOTHESIS_PROFILE naming
    no profile is not even read (it would be a usage error)."""
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "no-such-profile")
    config = _parse(pytester, "--hypothesis-profile", "dev")
    session_tuning.load_hypothesis_profile(config)
    assert settings.get_current_profile_name() != "no-such-profile"


def test_the_environment_chooses_when_hypothesis_plugin_is_off(settings, pytester, monkeypatch):
    """With hypothesis's pytest plugin disabled its option does not exist: the profile
    still comes from HYPOTHESIS_PROFILE."""
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "thorough")
    config = _parse(pytester, "-p", "no:hypothesispytest")
    session_tuning.load_hypothesis_profile(config)
    assert settings.get_current_profile_name() == "thorough"
    assert settings.default.max_examples == session_tuning.PROFILE_EXAMPLES["thorough"]


def test_an_unknown_profile_is_a_usage_error_naming_it(settings, pytester, monkeypatch):
    """HYPOTHESIS_PROFILE=typo: one usage error naming the variable and its value."""
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "thorogh")
    with pytest.raises(pytest.UsageError) as error:
        session_tuning.load_hypothesis_profile(_parse(pytester))
    assert str(error.value).startswith("HYPOTHESIS_PROFILE='thorogh': ")
    assert "thorogh" in str(error.value).removeprefix("HYPOTHESIS_PROFILE='thorogh': ")
