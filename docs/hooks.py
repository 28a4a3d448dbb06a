"""MkDocs hook: the pages show the benchmark pictures, which live beside their results in
benchmark_results/, outside docs/. A page links a picture as ../benchmark_results/... (as GitHub
resolves it from docs/); this hook adds those pictures to the site under benchmark_results/ and
points the links there, so that `mkdocs build --strict` finds every link."""

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
FOLDER = "benchmark_results"


def on_files(files, config):
    for picture in sorted((ROOT / FOLDER).rglob("*.png")):
        files.append(
            File(
                picture.relative_to(ROOT).as_posix(),
                src_dir=str(ROOT),
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
        )
    return files


def on_page_markdown(markdown, page, config, files):
    return markdown.replace(f"](../{FOLDER}/", f"]({FOLDER}/")
