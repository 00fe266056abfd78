"""Every malformed-input case is rejected with an HSTUError naming the file and the line."""

import re
import shutil

import pytest

from hstu.data.prepare import prepare
from hstu.errors import HSTUError
from hstu.testing_data import PlantedSpec, write_dataset

SPEC = PlantedSpec(num_users=30, num_items=200, max_events=20)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine")
    names = ("ml-1m", "ml-20m", "kuairand-pure", "seq-txt")
    return {name: write_dataset(name, root / name, SPEC) for name in names}


def edit_line(path, number, new_text=None, encoding="utf-8", transform=None):
    lines = path.read_bytes().decode(encoding).split("\n")
    lines[number - 1] = new_text if transform is None else transform(lines[number - 1])
    path.write_bytes("\n".join(lines).encode(encoding))


def expect_error(dataset, src, tmp_path, file_name, line, match):
    pattern = f"{re.escape(file_name)}:{line}: .*{match}"
    with pytest.raises(HSTUError, match=pattern):
        prepare(dataset, src, tmp_path / "out")
    assert not (tmp_path / "out" / "manifest.json").exists()


def copy(pristine, name, tmp_path):
    src = pristine[name]
    if src.is_file():
        return shutil.copy(src, tmp_path / src.name)
    return shutil.copytree(src, tmp_path / "src")


ML1M_CASES = [
    ("ratings.dat", 7, lambda s: s.replace("::", ",", 1), "expected 4 fields separated by '::'"),
    ("ratings.dat", 9, lambda s: s.rsplit("::", 1)[0], "found 3"),  # missing column
    ("ratings.dat", 4, lambda s: "u1" + s, "column 'user' must be a non-negative integer"),
    ("ratings.dat", 5, lambda s: s + ".5", "column 'time' must be a non-negative integer"),
    ("ratings.dat", 3, lambda s: s.replace("::", ":", 1), "expected 4 fields"),
    ("movies.dat", 3, lambda s: "x" + s, "MovieID must be an integer"),
    ("users.dat", 2, lambda s: s + "::extra", "found 6 fields"),
]


@pytest.mark.parametrize("file_name, line, change, match", ML1M_CASES)
def test_ml1m_bad_lines(pristine, tmp_path, file_name, line, change, match):
    src = copy(pristine, "ml-1m", tmp_path)
    edit_line(src / file_name, line, transform=change, encoding="latin-1")
    expect_error("ml-1m", src, tmp_path, file_name, line, match)


def test_ml1m_rating_out_of_range_unknown_ids_and_truncation(pristine, tmp_path):
    src = copy(pristine, "ml-1m", tmp_path)
    edit_line(src / "ratings.dat", 6, "11::7::6::978300760")
    expect_error("ml-1m", src, tmp_path, "ratings.dat", 6, "Rating 6 is not in 1..5")
    edit_line(src / "ratings.dat", 6, "11::8::4::978300760")  # movie 8 = 3 * item + 7: none
    expect_error("ml-1m", src, tmp_path, "ratings.dat", 6, "movie 8 is not in movies.dat")
    edit_line(src / "ratings.dat", 6, "12::7::4::978300760")
    expect_error("ml-1m", src, tmp_path, "ratings.dat", 6, "user 12 is not in users.dat")
    data = (src / "ratings.dat").read_bytes()
    (src / "ratings.dat").write_bytes(data[:-5])  # a download cut inside the last line
    last = data.count(b"\n")
    expect_error("ml-1m", src, tmp_path, "ratings.dat", last, "looks truncated")


def test_ml20m_bad_files(pristine, tmp_path):
    src = copy(pristine, "ml-20m", tmp_path)
    ratings = src / "ratings.csv"
    edit_line(ratings, 1, "userId,movieId,timestamp")
    expect_error("ml-20m", src, tmp_path, "ratings.csv", 1, r"missing column\(s\) \['rating'\]")
    edit_line(ratings, 1, "userId,movieId,rating,timestamp")
    edit_line(ratings, 8, transform=lambda s: s.replace(",", "\t"))
    expect_error("ml-20m", src, tmp_path, "ratings.csv", 8, "expected 4 fields")
    edit_line(ratings, 8, "11,7,3.7,978300760")
    expect_error("ml-20m", src, tmp_path, "ratings.csv", 8, "rating 3.7 is not a half-star")
    edit_line(ratings, 8, "11,7,3.5e0,978300760")
    expect_error("ml-20m", src, tmp_path, "ratings.csv", 8, "column 'rating' must be a number")
    edit_line(ratings, 8, "11,11,3.5,978300760")  # 11 != 3 * item + 7
    expect_error("ml-20m", src, tmp_path, "ratings.csv", 8, "movie 11 is not in movies.csv")
    edit_line(ratings, 8, "11,7,3.5,97830076o")
    expect_error("ml-20m", src, tmp_path, "ratings.csv", 8, "column 'time'")


def test_kuairand_bad_files(pristine, tmp_path):
    src = copy(pristine, "kuairand-pure", tmp_path)
    first = src / "data" / "log_standard_4_08_to_4_21_pure.csv"
    second = src / "data" / "log_standard_4_22_to_5_08_pure.csv"
    header = first.read_text().split("\n")[0]
    edit_line(first, 1, header.replace("is_click", "click"))
    expect_error("kuairand-pure", src, tmp_path, first.name, 1, r"lacks column\(s\) \['is_click'\]")
    edit_line(first, 1, header)

    def set_field(index, value):
        return lambda s: ",".join(value if i == index else f for i, f in enumerate(s.split(",")))

    edit_line(second, 4, transform=set_field(5, "2"))  # is_click
    expect_error("kuairand-pure", src, tmp_path, second.name, 4, "'is_click' must be 0 or 1")
    edit_line(second, 4, transform=set_field(5, "0"))
    edit_line(second, 4, transform=set_field(1, "v17"))
    expect_error("kuairand-pure", src, tmp_path, second.name, 4, "column 'video_id'")
    edit_line(second, 4, transform=set_field(1, "8"))
    expect_error("kuairand-pure", src, tmp_path, second.name, 4, "video_id 8 is not in video_f")
    edit_line(second, 4, transform=set_field(1, "7"))
    edit_line(second, 4, transform=set_field(0, "2"))
    expect_error("kuairand-pure", src, tmp_path, second.name, 4, "user_id 2 is not in user_feat")
    edit_line(second, 4, transform=set_field(0, "1"))
    edit_line(second, 4, transform=lambda s: s + ",1")
    expect_error("kuairand-pure", src, tmp_path, second.name, 4, "expected 19 fields")


def test_seq_txt_bad_files(pristine, tmp_path):
    path = copy(pristine, "seq-txt", tmp_path)
    lines = path.read_text().split("\n")
    user = lines[9].split()[0]
    later = next(i for i in range(10, len(lines)) if lines[i].split()[0] == user)
    edit_line(path, later + 1, f"{user} 7 5")  # earlier than the user's line 10
    expect_error("seq-txt", path, tmp_path, path.name, later + 1, "earlier than .* on line 10")
    edit_line(path, later + 1, lines[later])
    edit_line(path, 12, transform=lambda s: s.rsplit(" ", 1)[0])
    expect_error("seq-txt", path, tmp_path, path.name, 12, "expected 3 fields separated by ' '")
    edit_line(path, 12, lines[11].replace(" ", "\t", 1))
    expect_error("seq-txt", path, tmp_path, path.name, 12, "expected 3 fields")
    edit_line(path, 12, lines[11] + "x")
    expect_error("seq-txt", path, tmp_path, path.name, 12, "column 'time'")
