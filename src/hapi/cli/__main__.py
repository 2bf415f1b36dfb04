from hapi.cli import main

main()
