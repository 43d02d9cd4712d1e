"""Built-in device and link profiles load, are complete, plausible and cited; bad files fail clearly."""

from __future__ import annotations

import dataclasses
import re
from importlib import resources
from pathlib import Path

import pytest

from devices.profiles import (
    DeviceProfile,
    LinkProfile,
    list_devices,
    list_links,
    load_device,
    load_link,
)
from shared.errors import ConfigError

DEVICES = ["coral-dev-board", "jetson-nano", "jetson-orin-nano", "raspberry-pi-4b", "x86-laptop"]
LINKS = ["3g", "ethernet", "lte", "wifi"]


def test_every_issue_listed_profile_is_built_in():
    assert list_devices() == DEVICES
    assert list_links() == LINKS


@pytest.mark.parametrize("name", DEVICES)
def test_built_in_device_loads_with_every_field_set_and_plausible(name):
    d = load_device(name)
    assert isinstance(d, DeviceProfile) and d.name == name and d.description
    assert 1 <= d.cores <= 16
    assert 0.5 <= d.idle_power_w < d.compute_power_w <= 60
    assert 0.01 <= d.speed_factor <= 50
    if d.accelerator is None:
        assert d.accelerator_power_w is None
    else:
        assert d.accelerator_power_w is not None and 0 < d.accelerator_power_w <= d.compute_power_w
    assert d.battery_wh is None or 5 <= d.battery_wh <= 150
    for field in dataclasses.fields(d):
        value = getattr(d, field.name)
        assert value is None or isinstance(value, (str, int, float)), field.name


def test_device_figures_match_the_cited_public_measurements():
    pi = load_device("raspberry-pi-4b")
    assert (pi.idle_power_w, pi.compute_power_w, pi.cores, pi.accelerator) == (2.7, 6.4, 4, None)
    assert pi.speed_factor > 1  # slower than the development machine
    assert load_device("jetson-nano").compute_power_w == 10.0  # MAXN mode
    assert 7.0 <= load_device("jetson-orin-nano").compute_power_w <= 15.0
    coral = load_device("coral-dev-board")
    assert coral.accelerator == "edgetpu" and coral.accelerator_power_w == 2.0
    assert 2.0 <= coral.idle_power_w < coral.compute_power_w <= 4.0
    assert load_device("x86-laptop").battery_wh is not None


@pytest.mark.parametrize("name", LINKS)
def test_built_in_link_loads_with_every_field_set_and_plausible(name):
    link = load_link(name)
    assert isinstance(link, LinkProfile) and link.name == name and link.kind == name
    assert 0.1 <= link.up_mbps <= 10_000 and 0.1 <= link.down_mbps <= 10_000
    assert 0 < link.rtt_ms <= 500
    assert 0 < link.alpha_up_w_per_mbps <= 1.0 and 0 < link.alpha_down_w_per_mbps <= 1.0
    assert 0 < link.base_power_w <= 2.0
    assert 0 <= link.promotion_s <= 3 and 0 <= link.tail_s <= 15
    assert 0 <= link.promotion_power_w <= 2.0 and 0 <= link.tail_power_w <= 2.0
    assert link.metered == (link.kind in ("lte", "3g"))
    assert link.cost_per_mb >= 0 and (link.cost_per_mb > 0) == link.metered


def test_lte_carries_the_huang_mobisys_2012_parameters():
    lte = load_link("lte")
    assert lte.alpha_up_w_per_mbps == pytest.approx(0.438, abs=1e-3)
    assert lte.alpha_down_w_per_mbps == pytest.approx(0.052, abs=1e-3)
    assert lte.base_power_w == pytest.approx(1.288, abs=1e-3)
    assert lte.promotion_s == pytest.approx(0.26, abs=1e-2)
    assert lte.promotion_power_w == pytest.approx(1.21, abs=1e-2)
    assert lte.tail_s == pytest.approx(11.6, abs=0.1)
    assert lte.tail_power_w == pytest.approx(1.06, abs=1e-3)


def test_radio_tails_order_as_the_paper_measured_them():
    wifi, g3, lte, eth = (load_link(n) for n in ("wifi", "3g", "lte", "ethernet"))
    assert eth.tail_s == 0 < wifi.tail_s < 1 < g3.tail_s < lte.tail_s
    assert wifi.tail_power_w < g3.tail_power_w < lte.tail_power_w
    assert wifi.base_power_w < g3.base_power_w < lte.base_power_w


@pytest.mark.parametrize(("folder", "names"), [("profiles", DEVICES), ("links", LINKS)])
def test_every_number_in_a_built_in_file_has_a_source_comment(folder, names):
    number = re.compile(r"^\s*(\w+)\s*=\s*[-+]?\d")
    for name in names:
        lines = resources.files("devices").joinpath(folder, f"{name}.toml").read_text().splitlines()
        for i, line in enumerate(lines):
            m = number.match(line)
            if not m or m.group(1) in ("promotion_power_w", "tail_power_w", "cost_per_mb"):
                continue  # ethernet zeros and wifi's free data sit next to their explanation
            following = " ".join(lines[i : i + 2])
            assert "# source:" in following, f"{folder}/{name}.toml line {i + 1}: {line!r}"


def test_a_profile_can_be_loaded_from_a_path(tmp_path: Path):
    text = resources.files("devices").joinpath("profiles", "raspberry-pi-4b.toml").read_text()
    path = tmp_path / "my-pi.toml"
    path.write_text(text.replace("compute_power_w = 6.4", "compute_power_w = 7.1"))
    d = load_device(path)
    assert d.compute_power_w == 7.1 and d.name == "raspberry-pi-4b"
    assert load_device(str(path)) == d


def test_a_minimal_link_file_takes_its_name_from_the_file_and_defaults_the_rest(tmp_path: Path):
    path = tmp_path / "sat.toml"
    path.write_text(
        'kind = "lte"\nup_mbps = 5\ndown_mbps = 50\nrtt_ms = 600\nalpha_up_w_per_mbps = 0.5\n'
        "alpha_down_w_per_mbps = 0.1\nbase_power_w = 1\npromotion_s = 0\npromotion_power_w = 0\n"
        "tail_s = 0\ntail_power_w = 0\n"
    )
    link = load_link(path)
    assert link.name == "sat" and link.up_mbps == 5.0 and isinstance(link.up_mbps, float)
    assert link.metered is False and link.cost_per_mb == 0.0


def test_unknown_key_is_a_config_error_naming_file_and_key(tmp_path: Path):
    path = tmp_path / "bad.toml"
    text = resources.files("devices").joinpath("profiles", "jetson-nano.toml").read_text()
    path.write_text(text + "\nidle_power = 3.0\n")
    with pytest.raises(ConfigError) as err:
        load_device(path)
    assert str(path) in err.value.message and "'idle_power'" in err.value.message


def test_wrong_type_is_a_config_error_naming_file_and_key(tmp_path: Path):
    path = tmp_path / "bad-link.toml"
    text = resources.files("devices").joinpath("links", "wifi.toml").read_text()
    path.write_text(text.replace("up_mbps = 20.0", 'up_mbps = "fast"'))
    with pytest.raises(ConfigError, match=r"bad-link\.toml: key 'up_mbps' must be a float"):
        load_link(path)
    path.write_text(text.replace("metered = false", "metered = 0"))
    with pytest.raises(ConfigError, match="key 'metered' must be a bool"):
        load_link(path)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("cores = 4", "cores = 4.5"), "key 'cores' must be an int"),
        (("cores = 4", ""), "missing required key 'cores'"),
        (("idle_power_w = 1.5", "idle_power_w = -1.5"), "'idle_power_w' must be >= 0"),
        (("compute_power_w = 10.0", "compute_power_w = 1.0"), "below 'idle_power_w'"),
        (("speed_factor = 0.3", "speed_factor = nan"), "finite"),
        (("cores = 4", "cores = 4\n[extra]\nx = 1"), "unknown key 'extra'"),
    ],
)
def test_bad_device_values_are_config_errors(tmp_path: Path, edit, message):
    path = tmp_path / "nano.toml"
    text = resources.files("devices").joinpath("profiles", "jetson-nano.toml").read_text()
    assert edit[0] in text
    path.write_text(text.replace(edit[0], edit[1], 1))
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_device(path)


def test_bad_link_kind_and_invalid_toml_are_config_errors(tmp_path: Path):
    path = tmp_path / "l.toml"
    text = resources.files("devices").joinpath("links", "lte.toml").read_text()
    path.write_text(text.replace('kind = "lte"', 'kind = "5g"'))
    with pytest.raises(ConfigError, match="key 'kind' must be one of wifi, lte, 3g, ethernet"):
        load_link(path)
    path.write_text("kind = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_link(path)


def test_unknown_built_in_name_and_missing_file_are_config_errors(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"unknown device profile 'pi-zero'.*raspberry-pi-4b"):
        load_device("pi-zero")
    with pytest.raises(ConfigError, match=r"unknown link profile '5g'.*wifi"):
        load_link("5g")
    with pytest.raises(ConfigError, match="unknown link profile 'LTE'"):
        load_link("LTE")  # names are exact: no case folding
    with pytest.raises(ConfigError, match="cannot read link profile"):
        load_link(tmp_path / "absent.toml")
