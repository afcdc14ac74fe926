"""Documents for the index tests, written by real writers: Pillow's PDF and TIFF writers, pypdf's
encryption. Pages carry a black square at a known place on white so geometry can be checked."""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw

PAGE_SIZE = (420, 560)  # a small letter-shaped page


def page(label: str, size: tuple[int, int] = PAGE_SIZE, box: tuple[int, int, int, int] | None = None) -> Image.Image:
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    draw.text((20, 20), label, fill="black")
    if box:
        draw.rectangle(box, fill="black")
    return image


def write_pdf(path: Path, labels: list[str]) -> Path:
    pages = [page(label) for label in labels]
    pages[0].save(path, save_all=True, append_images=pages[1:], resolution=72)
    return path


def write_tiff(path: Path, labels: list[str]) -> Path:
    pages = [page(label) for label in labels]
    pages[0].save(path, save_all=True, append_images=pages[1:])
    return path


def write_encrypted_pdf(path: Path) -> Path:
    from pypdf import PdfReader, PdfWriter

    plain = write_pdf(path.with_suffix(".plain.pdf"), ["secret"])
    writer = PdfWriter()
    for p in PdfReader(plain).pages:
        writer.add_page(p)
    writer.encrypt("open sesame")
    with open(path, "wb") as f:
        writer.write(f)
    plain.unlink()
    return path


def good_folder(folder: Path) -> dict[str, int]:
    """Two PDFs, a PNG and a two-page TIFF; returns file name -> pages."""
    folder.mkdir(parents=True, exist_ok=True)
    write_pdf(folder / "report.pdf", ["report 1", "report 2", "report 3"])
    write_pdf(folder / "memo.pdf", ["memo"])
    page("photo").save(folder / "photo.png")
    write_tiff(folder / "scan.tiff", ["scan 1", "scan 2"])
    return {"report.pdf": 3, "memo.pdf": 1, "photo.png": 1, "scan.tiff": 2}


def bad_folder(folder: Path) -> dict[str, str]:
    """Files that must fail or be skipped, with a word their reason must contain."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "empty.pdf").write_bytes(b"")
    (folder / "corrupt.pdf").write_bytes(b"%PDF-1.7\n this is not a PDF body\n")  # deliberately corrupt
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 16)  # truncated PNG header
    write_encrypted_pdf(folder / "locked.pdf")
    (folder / "notes.txt").write_text("not a document")
    return {"empty.pdf": "empty", "corrupt.pdf": "PDF", "broken.png": "image",
            "locked.pdf": "encrypted", "notes.txt": "not a PDF or image"}


def tiff_with_a_bad_page(path, pages: int, bad: int):
    """A deflate-compressed multi-page TIFF whose page `bad` has a damaged strip (as a scan with
    a bad sector would): the other pages decode."""
    frames = [page(f"scan {n}") for n in range(1, pages + 1)]
    frames[0].save(path, save_all=True, append_images=frames[1:], compression="tiff_deflate")
    with Image.open(path) as image:
        image.seek(bad - 1)
        offset, count = image.tag_v2[273][0], image.tag_v2[279][0]
    data = bytearray(path.read_bytes())
    data[offset + 2:offset + count] = b"\xff" * (count - 2)
    path.write_bytes(bytes(data))
    return path


def write_text_pdf(path: Path, pages: list[list[str]], size: tuple[int, int] = PAGE_SIZE) -> Path:
    """A PDF whose pages carry a real text layer (lines of Helvetica, one of PDF's standard
    fonts, drawn by content-stream text operators), as a word processor's export would: what
    pdfium's text extraction reads. Written object by object with an exact cross-reference
    table."""
    def escaped(line: str) -> str:
        return line.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")

    objects: list[bytes] = []
    font = 3 + 2 * len(pages)
    kids = " ".join(f"{3 + 2 * i} 0 R" for i in range(len(pages)))
    objects.append(b"<< /Type /Catalog /Pages 2 0 R >>")
    objects.append(f"<< /Type /Pages /Kids [{kids}] /Count {len(pages)} >>".encode())
    for i, lines in enumerate(pages):
        ops = ["BT", "/F1 14 Tf", "16 TL", f"40 {size[1] - 60} Td"]
        ops += [f"({escaped(line)}) Tj T*" for line in lines]
        stream = ("\n".join(ops + ["ET"])).encode("latin-1")
        objects.append(f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 {size[0]} {size[1]}] "
                       f"/Resources << /Font << /F1 {font} 0 R >> >> /Contents {4 + 2 * i} 0 R >>"
                       .encode())
        objects.append(b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream")
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica "
                   b"/Encoding /WinAnsiEncoding >>")
    out = bytearray(b"%PDF-1.7\n")
    offsets = []
    for n, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % n + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1,
                                                                                 xref)
    path.write_bytes(bytes(out))
    return path
