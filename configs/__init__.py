"""Packaged recipes: `hstu train --config demo` (or any other file name here, without
`.yaml`) finds them from any directory. Installed as the `hstu_recipes` package."""
