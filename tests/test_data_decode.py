"""Decoding: the bad-image policy, DCT-domain downscaling, uint8 resizing against references."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from data_images import jpeg_bytes, photo, write_bad_folder
from PIL import Image

from cnnkit.data import decode
from cnnkit.data.decode import BadImage, load_resized, read_image
from cnnkit.data.resize import resize_uint8


@pytest.fixture(params=["turbo", "pillow"])
def backend(request, monkeypatch):
    """Run each test with simplejpeg and with the Pillow fallback."""
    if request.param == "pillow":
        monkeypatch.setattr(decode, "simplejpeg", None)
    elif decode.simplejpeg is None:
        pytest.skip("simplejpeg not installed")
    return request.param


def test_bad_images_reported_odd_ones_converted(tmp_path, backend):
    expected = write_bad_folder(tmp_path)
    for rel, status in expected.items():
        if status == "skipped":
            with pytest.raises(BadImage) as err:
                read_image(tmp_path / rel)
            assert str(err.value)  # a reason, for the report
        else:
            array, _ = read_image(tmp_path / rel)
            assert array.dtype == np.uint8 and array.shape == (30, 40, 3)
    reasons = {}
    for rel in ("odd/empty.JPEG", "odd/truncated.JPEG", "odd/text.JPEG"):
        with pytest.raises(BadImage) as err:
            read_image(tmp_path / rel)
        reasons[rel] = str(err.value)
    assert reasons["odd/empty.JPEG"] == "empty file"
    assert "truncated" in reasons["odd/truncated.JPEG"]
    assert "not an image" in reasons["odd/text.JPEG"]


def test_a_jpeg_with_stray_bytes_decodes_as_pillow_does(tmp_path, backend):
    """libjpeg's recoverable warning (bytes before the end marker, seen in ImageNet): decoded
    to the same pixels as the intact file and noted; a truncated file is still refused."""
    data = jpeg_bytes(photo(seed=5))
    (tmp_path / "ok.jpg").write_bytes(data)
    (tmp_path / "stray.jpg").write_bytes(data[:-2] + b"\0\0\0\0" + data[-2:])
    (tmp_path / "cut.jpg").write_bytes(data[: len(data) * 2 // 3])
    intact, _ = read_image(tmp_path / "ok.jpg")
    stray, note = read_image(tmp_path / "stray.jpg")
    np.testing.assert_array_equal(stray, intact)
    np.testing.assert_array_equal(stray, np.asarray(Image.open(tmp_path / "stray.jpg")))
    if backend == "turbo":
        assert note == "decoded despite libjpeg's warning: Corrupt JPEG data: 4 extraneous " \
                       "bytes before marker 0xd9"  # fmt: skip
    with pytest.raises(BadImage, match="truncated"):
        read_image(tmp_path / "cut.jpg")


def test_conversion_notes_and_values(tmp_path):
    write_bad_folder(tmp_path)
    grey, note = read_image(tmp_path / "odd/grey.JPEG")
    assert (grey[..., 0] == grey[..., 1]).all() and (grey[..., 1] == grey[..., 2]).all()
    png, note = read_image(tmp_path / "good/png_inside.JPEG")
    assert note == "PNG data in a .JPEG file"
    np.testing.assert_array_equal(png, photo(seed=23))  # lossless PNG: exact pixels
    cmyk, note = read_image(tmp_path / "odd/cmyk.JPEG")
    reference = np.asarray(Image.open(tmp_path / "odd/cmyk.JPEG").convert("RGB"))
    np.testing.assert_array_equal(cmyk, reference)
    assert note == "CMYK -> RGB"


def test_huge_non_jpeg_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(decode, "MAX_PIXELS", 100)
    Image.fromarray(photo()).save(tmp_path / "big.png")
    with pytest.raises(BadImage, match="huge"):
        read_image(tmp_path / "big.png")


def test_a_pack_record_claiming_huge_dimensions_is_refused_before_decoding(backend):
    """A damaged JPEG record of a pack whose header claims 60000 x 60000 pixels: BadImage from
    its header, as every other decode checks, not a 10 GB allocation."""
    record = bytearray(jpeg_bytes(photo(32, 32)))
    sof = record.index(b"\xff\xc0")
    record[sof + 5 : sof + 9] = (60000).to_bytes(2, "big") * 2  # height, width
    with pytest.raises(BadImage, match=r"huge image \((60000x60000 =|3,600,000,000 pixels)"):
        decode.decode_jpeg_bytes(bytes(record), 32)
    assert decode.decode_jpeg_bytes(jpeg_bytes(photo(32, 32)), 32).shape == (32, 32, 3)


def test_dct_downscaling_never_goes_below_the_size_needed(tmp_path, backend):
    path = tmp_path / "big.jpg"
    path.write_bytes(jpeg_bytes(photo(480, 640)))
    full, _ = read_image(path)
    assert full.shape == (480, 640, 3)
    # the decode keeps twice the pixels needed: the resize's filter does the last halving
    squash, _ = read_image(path, 100, "squash")  # 1/2 scale: 240x320 >= 2 x 100; 1/4 not
    assert squash.shape == (240, 320, 3)
    shorter, _ = read_image(path, 60, "shorter")  # 1/4 scale: 120x160, shorter side >= 2 x 60
    assert shorter.shape == (120, 160, 3)
    small, _ = read_image(path, 200, "shorter")  # 1/2 would be 240 < 2 x 200: the full image
    assert small.shape == (480, 640, 3)


@pytest.mark.parametrize("mode", ["squash", "shorter"])
def test_dct_downscaling_keeps_the_geometry_when_sides_are_not_multiples(tmp_path, backend, mode):
    """258 x 330 at 1/4 (for 32 x 32: twice that kept) is 65 x 83 pixels whose last row and
    column cover 2 source pixels: resized as a full decode is, not stretched (on 16-pixel
    squares, the DCT filter alone is a few levels off a full decode; stretched, the squares'
    edges moved)."""
    y, x = np.mgrid[:258, :330]
    stripes = np.where(((x // 16) + (y // 16)) % 2 == 0, 30, 220).astype(np.uint8)
    path = tmp_path / "stripes.jpg"
    Image.fromarray(np.stack([stripes] * 3, -1)).save(path, quality=98, subsampling=0)
    array, _, factor, source = decode.decode_image(path, 32, mode)
    if mode == "shorter":  # the centre square starts on a decoded pixel's edge: column 36 here
        assert decode.dct_factor(258, 334, 32, mode) == 2  # column 38: a multiple of 2, not 4
    assert factor == 4 and array.shape == (65, 83, 3) and source == (258, 330)
    got = load_resized(path, 32, mode)[0].float()
    full = resize_uint8(read_image(path)[0], 32, mode).float()
    error = (got - full).abs()
    assert error.mean() < 5 and error.max() < 30  # 2-3 and 13-14 here (5-6 and 38 at 1/4 for 64)


def test_resize_matches_torch_interpolate_and_pil():
    image = photo(60, 80)
    x = torch.from_numpy(image.copy()).permute(2, 0, 1)[None].float()
    squash = resize_uint8(image, 32, "squash")
    ref = F.interpolate(x, size=(32, 32), mode="bilinear", antialias=True, align_corners=False)
    assert squash.shape == (3, 32, 32) and squash.dtype == torch.uint8
    assert (squash.float() - ref[0]).abs().max() <= 1  # uint8 rounding
    pil = np.asarray(Image.fromarray(image).resize((32, 32), Image.BILINEAR)).transpose(2, 0, 1)
    assert np.abs(squash.numpy().astype(int) - pil).mean() < 2
    shorter = resize_uint8(image, 30, "shorter")  # centre 60x60 square -> 30x30
    ref = F.interpolate(x[..., 10:70], size=(30, 30), mode="bilinear", antialias=True)
    assert (shorter.float() - ref[0]).abs().max() <= 1


def test_load_resized_same_result_for_jpeg_backends(tmp_path, monkeypatch):
    path = tmp_path / "a.jpg"
    path.write_bytes(jpeg_bytes(photo(64, 96)))
    turbo = load_resized(path, 48, "shorter").image
    monkeypatch.setattr(decode, "simplejpeg", None)
    pillow = load_resized(path, 48, "shorter").image
    assert (turbo.int() - pillow.int()).abs().float().mean() < 2  # same libjpeg-turbo inside


def _lzw_tiff(strip: bytes | None = None) -> bytes:
    """A 4x4 LZW TIFF (decoded by libtiff), its strip's data replaced by `strip` if given."""
    out = io.BytesIO()
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(out, "TIFF", compression="tiff_lzw")
    data = bytearray(out.getvalue())
    if strip is not None:
        tags = Image.open(io.BytesIO(bytes(data))).tag_v2
        start, count = tags[273][0], tags[279][0]
        data[start : start + count] = strip.ljust(count, b"\0")
    return bytes(data)


@pytest.mark.filterwarnings("ignore:Corrupt EXIF data")  # Pillow's, as the CLI keeps it quiet
def test_a_damaged_tiff_says_damaged_and_libtiff_prints_nothing(capfd):
    """LZW data with a code not yet in the table: libtiff printed `tempfile.tif: Using code not
    yet in table.` on stderr (a name the user never gave) and the reason was Pillow's
    `unreadable image (decoder error -2)`. A header past the file's end was 'a TIFF Pillow
    cannot read (float RGB or 64-bit samples?)': a guess at a valid file."""
    decode.decode_data(_lzw_tiff(), suffix=".tif")  # the intact file decodes
    with pytest.raises(BadImage, match=r"^damaged TIFF \(decoder error"):
        decode.decode_data(_lzw_tiff(b"\x80\x7f\xc0"), suffix=".tif")  # Clear, then code 511
    assert capfd.readouterr().err == ""
    header_past_the_end = _lzw_tiff()[:4] + (10**6).to_bytes(4, "little") + _lzw_tiff()[8:]
    with pytest.raises(BadImage, match=r"^damaged or unsupported TIFF \(Pillow cannot read"):
        decode.decode_data(header_past_the_end, suffix=".tif")


def test_a_valid_tiff_of_samples_pillow_cannot_read_says_which():
    tifffile = pytest.importorskip("tifffile")
    out = io.BytesIO()
    tifffile.imwrite(out, np.zeros((4, 5, 3), np.float32), photometric="rgb")
    with pytest.raises(BadImage, match=r"^a TIFF Pillow cannot read \(3 x 32-bit float samples\)"):
        decode.decode_data(out.getvalue(), suffix=".tif")


def test_a_32_bit_integer_image_reads_as_pillow_converts_it(tmp_path):
    """Pillow's mode I (0..254 here) was read as 16-bit (x >> 8): an all-black image. It reads
    as convert('RGB') does (clipped to 0..255), what torchvision's PIL loader gives; a 16-bit
    image keeps its top 8 bits."""
    ints = np.arange(64, dtype=np.int32).reshape(8, 8) * 4 - 20  # -20..232
    ints[0, :2] = 300, 70000
    Image.fromarray(ints).save(tmp_path / "int32.tif")  # int32: mode I
    array, note = read_image(tmp_path / "int32.tif")
    np.testing.assert_array_equal(
        array, np.asarray(Image.open(tmp_path / "int32.tif").convert("RGB"))
    )
    assert array[0, 2, 0] == 0 and array[7, 7, 0] == 232 and array[0, 0, 0] == 255
    assert note == "32-bit integer grey (clipped to 0..255, as Pillow reads it) -> 8-bit RGB"
    Image.fromarray((ints.clip(0, 255) * 256).astype(np.uint16)).save(tmp_path / "grey16.png")
    np.testing.assert_array_equal(read_image(tmp_path / "grey16.png")[0][..., 0], ints.clip(0, 255))


def test_fast_decoding_stays_within_a_level_of_the_exact_one():
    data = jpeg_bytes(photo(120, 160, seed=5), quality=90)
    exact = decode.decode_data(data).array.astype(int)
    fast = decode.decode_data(data, fast=True).array.astype(int)
    assert np.abs(fast - exact).mean() < 1.5  # fast upsampling and integer IDCT: about 1


def test_resizing_any_layout_gives_the_same_pixels():
    from cnnkit.data.resize import resize_crop

    hwc = torch.from_numpy(photo(70, 90, seed=6))
    planar = hwc.permute(2, 0, 1).contiguous()
    ref = F.interpolate(planar[None, :, 5:65, 3:80], size=(48, 48), mode="bilinear",
                        antialias=True)[0]  # fmt: skip
    for region in (planar[:, 5:65, 3:80], hwc.permute(2, 0, 1)[:, 5:65, 3:80]):
        np.testing.assert_array_equal(resize_crop(region, 48, False).numpy(), ref.numpy())
        np.testing.assert_array_equal(resize_crop(region, 48, True).numpy(), ref.flip(-1).numpy())
