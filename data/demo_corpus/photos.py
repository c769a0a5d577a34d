"""Photo part: real photographs that installed packages ship (`OUT/photos/<name>.<ext>` + `.txt`).

The files are copied byte for byte (the ingest step must see real-world JPEG/PNG encodings,
including greyscale and RGBA ones); the sidecar `.txt` holds a short factual caption we
wrote after looking at each picture. Only files present on disk are used, so an older or
newer scikit-image with a different sample set still builds.

Synthetic pictures that the packages also ship (colour wheel, chessboards, logo, phantom),
the face-detector XML, .npy/.npz arrays, multipage TIFFs and the animated GIF are left out:
they are not photographs, or have no single natural caption.
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil

from ._common import in_split, package_dir, write_text


@dataclasses.dataclass(frozen=True)
class Photo:
    package: str  # "skimage" or "sklearn"
    file: str  # file name inside the package's image folder
    caption: str  # the sidecar caption
    subject: str  # noun phrase for clip captions: "the camera pans right across a photograph of {subject}"
    source: str  # provenance and licence, as the package documents it


_SKI = "scikit-image (skimage/data)"
_SKL = "scikit-learn (sklearn/datasets/images)"

CATALOGUE: tuple[Photo, ...] = (
    Photo(
        "skimage",
        "astronaut.png",
        "A colour portrait photograph of NASA astronaut Eileen Collins in an orange flight suit, "
        "smiling, with an American flag on the left, a model of the space shuttle behind her and a "
        "helmet at the lower right.",
        "an astronaut",
        f"{_SKI}; NASA Great Images database; public domain, no known copyright restrictions.",
    ),
    Photo(
        "skimage",
        "camera.png",
        "A greyscale photograph of a man in a dark coat looking through a camera mounted on a "
        "tripod, standing on a lawn with buildings in the distance.",
        "a photographer with a tripod camera",
        f"{_SKI}; photographer Lav Varshney; CC0, no copyright restrictions (replaced the older 'cameraman' in 0.18).",
    ),
    Photo(
        "skimage",
        "cell.png",
        "A greyscale microscope image of a single round cell floating in saline, bright against a "
        "darker background with faint banding.",
        "a cell under a microscope",
        f"{_SKI}; quantitative phase image (qpformat); CC0.",
    ),
    Photo(
        "skimage",
        "chelsea.png",
        "A close-up colour photograph of the face of a tabby cat named Chelsea, with green eyes "
        "and a pink nose.",
        "a cat",
        f"{_SKI}; photographer Stefan van der Walt; CC0, no copyright restrictions.",
    ),
    Photo(
        "skimage",
        "clock_motion.png",
        "A greyscale photograph of a round wall clock, smeared horizontally by camera motion blur.",
        "a motion-blurred wall clock",
        f"{_SKI}; photographer Stefan van der Walt; released into the public domain.",
    ),
    Photo(
        "skimage",
        "coffee.png",
        "A colour photograph from above of a cup of espresso on a red saucer with a spoon, on a "
        "wooden table.",
        "a cup of coffee",
        f"{_SKI}; courtesy of Pikolo Espresso Bar, photographer Rachel Michetti; CC0.",
    ),
    Photo(
        "skimage",
        "coins.png",
        "A greyscale photograph of two dozen ancient Greek coins from Pompeii laid out in rows on "
        "a dark background.",
        "ancient coins",
        f"{_SKI}; Brooklyn Museum Collection; no known copyright restrictions.",
    ),
    Photo(
        "skimage",
        "brick.png",
        "A greyscale photograph of a brick wall seen at an angle, with rows of long bricks and "
        "light mortar lines.",
        "a brick wall",
        f"{_SKI}; CC0Textures (Bricks25), perspective-corrected and cropped; CC0.",
    ),
    Photo(
        "skimage",
        "grass.png",
        "A greyscale close-up photograph of grass filling the whole frame.",
        "grass",
        f"{_SKI}; DeviantArt (linolafett, Grass 01), cropped and converted to grey; CC0.",
    ),
    Photo(
        "skimage",
        "gravel.png",
        "A greyscale close-up photograph of gravel: many small stones filling the whole frame.",
        "gravel",
        f"{_SKI}; CC0Textures (Gravel04), rescaled, cropped and converted to grey; CC0.",
    ),
    Photo(
        "skimage",
        "horse.png",
        "A black silhouette of a standing horse, facing right, on a white background.",
        "the silhouette of a horse",
        f"{_SKI}; openclipart, by Andreas Preuss (marauder); CC0.",
    ),
    Photo(
        "skimage",
        "hubble_deep_field.jpg",
        "A colour astronomical photograph of the Hubble eXtreme Deep Field: thousands of small "
        "distant galaxies scattered over a black sky.",
        "distant galaxies",
        f"{_SKI}; NASA HubbleSite; public domain.",
    ),
    Photo(
        "skimage",
        "ihc.png",
        "A colour microscope image of colonic tissue: glands stained brown by immunohistochemistry "
        "and blue cell nuclei from hematoxylin counterstaining.",
        "stained tissue under a microscope",
        f"{_SKI}; Center for Microscopy And Molecular Imaging (CMMI); no known copyright restrictions.",
    ),
    Photo(
        "skimage",
        "microaneurysms.png",
        "A small greyscale crop of a retina photograph showing dark blood vessels and tiny dark "
        "spots.",
        "blood vessels of a retina",
        f"{_SKI}; crop of the High-Resolution Fundus (HRF) Image Database, by Andreas Maier; CC0.",
    ),
    Photo(
        "skimage",
        "moon.png",
        "A low-contrast greyscale photograph of the surface of the moon with a few craters.",
        "the surface of the moon",
        f"{_SKI}; the package states no source or licence for this file beyond its own BSD-3-Clause licence.",
    ),
    Photo(
        "skimage",
        "motorcycle_left.png",
        "A colour photograph of a red motorcycle standing in a garage, with shelves of boxes "
        "behind it.",
        "a red motorcycle",
        f"{_SKI}; Middlebury 2014 stereo benchmark (left view), Scharstein et al., down-sampled "
        "by 4; the package states no licence for it.",
    ),
    Photo(
        "skimage",
        "motorcycle_right.png",
        "A colour photograph of a red motorcycle standing in a garage, seen from slightly to the "
        "right, with shelves of boxes behind it.",
        "a red motorcycle",
        f"{_SKI}; Middlebury 2014 stereo benchmark (right view), Scharstein et al., down-sampled "
        "by 4; the package states no licence for it.",
    ),
    Photo(
        "skimage",
        "page.png",
        "A greyscale scan of a printed page headed 'Region-based segmentation', with unevenly lit "
        "paragraphs of text and a line of code.",
        "a printed page",
        f"{_SKI}; the package states no source or licence for this file beyond its own BSD-3-Clause licence.",
    ),
    Photo(
        "skimage",
        "retina.jpg",
        "A colour fundus photograph of a healthy human left eye: an orange-red retina in a black "
        "circle, with the bright optic disc on the left and branching blood vessels.",
        "a human retina",
        f"{_SKI}; Wikimedia Commons, Mikael Häggström; CC0.",
    ),
    Photo(
        "skimage",
        "rocket.jpg",
        "A colour photograph at dusk of a SpaceX Falcon 9 rocket standing on its launch pad "
        "between lightning towers under a dark blue sky.",
        "a rocket on its launch pad",
        f"{_SKI}; SpaceX Photos; released into the public domain by SpaceX.",
    ),
    Photo(
        "skimage",
        "text.png",
        "A greyscale photograph of handwritten notes and arrows on a sheet of paper, seen at an "
        "angle.",
        "handwritten notes",
        f"{_SKI}; Wikipedia (File:Corner.png); no known copyright restrictions, public domain.",
    ),
    Photo(
        "sklearn",
        "china.jpg",
        "A colour photograph of a multi-storey Chinese temple tower with red pillars and green "
        "roofs, surrounded by trees, with a lake behind it under a pale sky.",
        "a Chinese temple",
        f"{_SKL}; Flickr, danielbuechele; CC BY 2.0 (retrieved 2011 by Robert Layton).",
    ),
    Photo(
        "sklearn",
        "flower.jpg",
        "A colour close-up photograph of an orange dahlia flower in bloom against a dark green "
        "background.",
        "an orange flower",
        f"{_SKL}; Flickr, vultilion; CC BY 2.0 (retrieved 2011 by Robert Layton).",
    ),
)


def source_path(photo: Photo) -> pathlib.Path | None:
    root = package_dir(photo.package)
    if root is None:
        return None
    folder = root / "data" if photo.package == "skimage" else root / "datasets" / "images"
    path = folder / photo.file
    return path if path.is_file() else None


def split_group(photo: Photo) -> str:
    """The two views of the stereo pair (motorcycle_left/right) are one group: never split."""
    return photo.file.replace("_left", "").replace("_right", "")


def available(split: str = "all") -> list[tuple[Photo, pathlib.Path]]:
    """The catalogue entries of ``split`` whose files exist in this environment, in catalogue
    order."""
    return [
        (p, src)
        for p in CATALOGUE
        if in_split(split_group(p), split) and (src := source_path(p)) is not None
    ]


def build_photos(out: pathlib.Path, split: str = "all") -> dict:
    folder = out / "photos"
    folder.mkdir(parents=True, exist_ok=True)
    total = files = 0
    for photo, src in available(split):
        dst = folder / photo.file
        shutil.copyfile(src, dst)  # original bytes, unchanged
        total += dst.stat().st_size
        total += write_text(dst.with_suffix(".txt"), photo.caption + "\n")
        files += 1
    return {"images": files, "bytes": total}
