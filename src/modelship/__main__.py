from modelship.cli import main

main()
