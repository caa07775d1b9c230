from forge.cli import main

main()
