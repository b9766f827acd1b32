import sys

from ktd.http.serve import main

sys.exit(main())
