from .cli.main import main
from .parallel.ranks import exit_process

exit_process(main())
