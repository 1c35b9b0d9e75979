"""A ``tinker://`` path (``serving/tinker/service.py:parse_tinker_path``) names a folder inside the
service's store and nothing else: no parent folders, no hidden names, only the API's kinds."""

import pytest

from serving.tinker.futures import UserError


def test_a_tinker_path_names_a_folder_inside_the_store_only():
    from serving.tinker.service import parse_tinker_path

    assert parse_tinker_path("tinker://s1:train:0/weights/step-3") == ("s1:train:0", "weights", "step-3")
    for bad in (
        "tinker://../weights/x",
        "tinker://m/weights/../x",
        "tinker://m/other/x",
        "/abs/path",
        "tinker://m/weights",
        "tinker://m/weights/..",
    ):
        with pytest.raises(UserError):
            parse_tinker_path(bad)
