"""Format names and exact storage costs."""

import pytest

from pipeline.quant.formats import GRAMMAR, Format, as_format, parse_format

ALL_FORMATS = (
    [
        f"int{b}{g}{s}"
        for b in (2, 3, 4, 8)
        for g in ("", "g32", "g64", "g128")
        for s in ("", "-sym")
    ]
    + [f"exp4g{g}{d}" for g in (32, 64, 128) for d in ("", "-design")]
    + ["float"]
)


@pytest.mark.parametrize("name", ALL_FORMATS)
def test_every_name_in_the_grammar_parses_and_round_trips(name):
    fmt = parse_format(name)
    assert fmt.name == name
    assert parse_format(fmt.name) == fmt


def test_parsed_fields():
    assert parse_format("int4g128") == Format("int4g128", "int", 4, 128, False)
    assert parse_format("int3g64-sym") == Format("int3g64-sym", "int", 3, 64, True)
    assert parse_format("int8") == Format("int8", "int", 8, 0, False)
    assert parse_format("exp4g32") == Format("exp4g32", "exp", 4, 32, True)
    design = parse_format("exp4g128-design")
    assert design == Format("exp4g128-design", "exp", 4, 128, True, "design")
    assert design.bits_per_weight(4096) == parse_format("exp4g128").bits_per_weight(4096)
    assert parse_format("float").kind == "float"


@pytest.mark.parametrize(
    "bad", ["int5g128", "int4g100", "int4g", "exp4", "exp3g128", "exp4g128-sym", "fp16", "", "INT4"]
)
def test_bad_names_raise_with_the_grammar(bad):
    with pytest.raises(ValueError) as err:
        parse_format(bad)
    assert repr(bad) in str(err.value)
    assert GRAMMAR in str(err.value)


def test_non_string_raises():
    with pytest.raises(ValueError, match="allowed"):
        parse_format(4)


@pytest.mark.parametrize(
    ("name", "in_features", "bits"),
    [
        ("int4g128", 4096, 4 + (16 + 4) / 128),  # fp16 scale + 4-bit zero per group
        ("int4g128-sym", 4096, 4 + 16 / 128),  # no zero point
        ("int2g64", 4096, 2 + (16 + 2) / 64),
        ("int3g128", 4096, 3 + (16 + 3) / 128),
        ("int8", 4096, 8 + (16 + 8) / 4096),  # one group per output channel
        ("exp4g128", 4096, 4 + 32 / 128),  # fp16 base + fp16 ratio
        ("float", 4096, 16.0),
        ("int4g128", 200, (4 * 200 + 2 * 20) / 200),  # partial last group costs a full set
    ],
)
def test_bits_per_weight_exact(name, in_features, bits):
    assert parse_format(name).bits_per_weight(in_features) == pytest.approx(bits, abs=1e-12)


def test_bits_per_weight_rejects_empty_rows():
    with pytest.raises(ValueError, match="in_features"):
        parse_format("int4g128").bits_per_weight(0)


def test_only_names_are_parsed_and_formats_pass_through_as_format():
    fmt = parse_format("int4g128")
    with pytest.raises(ValueError, match="must be a string, got Format"):
        parse_format(fmt)
    assert as_format(fmt) is fmt and as_format("int4g128") == fmt
