"""`python -m polyserve.settings`: print the settings table, or write it into docs/settings.md."""

import sys

from polyserve.settings.docs import markdown_table, write_readme

if sys.argv[1:] == ["--readme"]:
    write_readme()
else:
    print(markdown_table())
